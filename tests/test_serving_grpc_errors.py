"""Serving's gRPC front end refuses bytes that are not its messages with INVALID_ARGUMENT and a message.

The front end is started in this process on an empty model folder: a request that cannot be decoded is
refused before readiness matters, so no model is needed.
"""

from __future__ import annotations

import grpc
import pytest
from helpers_serving import serving_in_thread

from elastic_control.serving.versions import ModelDirSource

BAD_MESSAGES = {
    "truncated varint": b"\x0a\xff",
    "length past the end": b"\x0a\x10abc",
    "garbage": b"\xff\xff\xff\xff",
    "invalid UTF-8 in a string": b"\x0a\x04\x0a\x02\xff\xfe",
}


@pytest.fixture(scope="module")
def grpc_target(tmp_path_factory):
    models = tmp_path_factory.mktemp("no-models")
    with serving_in_thread(ModelDirSource(models), wait_ready=False, grpc=True) as srv:
        yield srv.grpc_target


@pytest.mark.parametrize("method", ["Predict", "Feedback"])
@pytest.mark.parametrize("what", sorted(BAD_MESSAGES))
def test_undecodable_messages_are_invalid_argument(grpc_target, method, what):
    with grpc.insecure_channel(grpc_target) as channel:
        call = channel.unary_unary(f"/elasticctr.serving.v1.Prediction/{method}")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as e:
            call(BAD_MESSAGES[what], timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert "malformed" in e.value.details() and "Unexpected" not in e.value.details()


def test_a_valid_message_still_reaches_the_service(grpc_target):
    """An empty PredictRequest decodes; it is refused for what it says (no instances), not for its bytes."""
    with grpc.insecure_channel(grpc_target) as channel:
        call = channel.unary_unary("/elasticctr.serving.v1.Prediction/Predict")
        with pytest.raises(grpc.RpcError) as e:
            call(b"", timeout=10)
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE), e.value.details()
    assert "malformed" not in e.value.details()
