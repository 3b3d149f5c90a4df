"""Serving: joins cube's sparse embeddings with the dense model and answers predictions over HTTP and gRPC.

Modules: ``instances`` (request bodies -> validated feature columns, per request), ``versions`` (where
the active version comes from and how a version's dense model is fetched), ``lookup`` (cube or
in-memory embedding lookups), ``cache`` (the hot-key embedding cache), ``batcher`` (merged batches,
one predictor per worker thread), ``arms`` (A/B splits and routing), ``pins`` (the versions serving
asks cube to keep), ``feedback`` (predictions remembered for click feedback), ``monitor`` (live
per-arm metrics and alerts), ``recording`` (MLflow), ``app`` (versions, split, readiness),
``routes`` (HTTP), ``grpc_frontend`` (gRPC), ``http_server`` (listeners and the drain),
``ab_report`` (``elastic-control ab-report``), ``metrics`` and ``cli`` (``elastic-control serve``).
"""
