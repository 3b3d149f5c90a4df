"""ElasticCTR: click-through-rate models from raw click logs to live predictions."""

from ctr_foundation import __version__

__all__ = ["__version__"]
