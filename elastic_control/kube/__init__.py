"""Kubernetes: the one adaptor module and manifest rendering."""
