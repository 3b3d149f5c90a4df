"""The ElasticCTR client: library (client.api) and command line (client.cli)."""
