"""ElasticCTR: click-through-rate models from raw click logs to live predictions."""

__version__ = "0.1.0"
