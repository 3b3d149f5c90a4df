"""Serving's gRPC API: ``serving.proto`` and the modules protoc generates from it (committed).

Regenerate after editing the .proto, from the repository root::

    .venv/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. ctr_foundation/grpc_api/serving.proto

(grpcio-tools 1.62.x, pinned in requirements-dev.txt: newer releases generate code for protobuf 5,
which Paddle 2.6.2 cannot use.) ``tests/test_grpc_api.py`` checks the committed modules match.
"""

SERVICE = "elasticctr.serving.v1.Prediction"
