"""The local backend's machinery: ports, component plans, the supervisor and its runtime state.

Everything the pipeline runs on Kubernetes runs here as supervised local
processes started with the same entry points and environment variables.
"""
