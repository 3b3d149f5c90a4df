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


@pytest.mark.parametrize("dense", [False, True])
def test_a_slot_beyond_the_grammar_is_refused_as_in_json(dense):
    from ctr_foundation.grpc_api import serving_pb2
    from elastic_control.serving.grpc_frontend import parse_proto_instances
    from elastic_control.serving.instances import InstanceError

    inst = serving_pb2.Instance()
    if dense:
        inst.slots.dense[10**9] = 1.5
    else:
        inst.slots.slots[10**9].feasigns.append(7)
    with pytest.raises(InstanceError, match=r"instance 0: unknown slot '1000000000'; slot 1000000000 has more than 9"):
        parse_proto_instances([inst])
    ok = serving_pb2.Instance()
    ok.slots.slots[10**9 - 1].feasigns.append(7)
    parse_proto_instances([ok])  # the largest slot id the grammar has
