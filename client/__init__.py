"""The ElasticCTR client: library and command line."""
