"""Serving: joins cube's sparse embeddings with the dense model and answers POST /v1/predict.

Modules: ``instances`` (request parsing into key batches), ``versions`` (where
the active version comes from and how its dense model is fetched),
``lookup`` (cube or in-memory embedding lookups), ``batcher`` (merging
concurrent requests), ``metrics``, ``app`` (HTTP routes, hot reload) and
``cli`` (``elastic-control serve``).
"""
