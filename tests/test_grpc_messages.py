"""The gRPC front end's own message work: the PredictResponse bytes it writes from an Answer are the ones
protobuf writes, and a request's lines reach the batcher as they are (parse_proto_instances)."""

from __future__ import annotations

import numpy as np
import pytest

from ctr_foundation.grpc_api import serving_pb2
from elastic_control.serving.batcher import Answer
from elastic_control.serving.grpc_frontend import parse_proto_instances
from elastic_control.serving.grpc_reply import predict_reply
from elastic_control.serving.instances import InstanceError, UnparsedLines

LINE = "1 0 5:1 7:2"


def _protobuf_bytes(answer: Answer) -> bytes:
    return serving_pb2.PredictResponse(
        probabilities=answer.probabilities.tolist(),
        request_id=answer.request_id,
        arm=answer.arm,
        model_version=answer.model_version,
        cube_version=answer.cube_version,
    ).SerializeToString()


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 5000])  # 32 floats: a length of 128, the first 2-byte varint
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_reply_is_what_protobuf_writes(n, dtype):
    rng = np.random.default_rng(n)
    probabilities = rng.random(n).astype(dtype)
    if n > 3:
        probabilities[:3] = (0.0, 1.0, np.float32(1e-30))
    answer = Answer(probabilities, "r" * 200, "arm-é", "pass-20200101-00", "cube-7")
    got = predict_reply(answer)
    assert got == _protobuf_bytes(answer)
    back = serving_pb2.PredictResponse.FromString(got)
    assert np.array_equal(np.array(back.probabilities, np.float32), probabilities.astype(np.float32))
    assert (back.request_id, back.arm, back.model_version, back.cube_version) == (
        answer.request_id,
        answer.arm,
        answer.model_version,
        answer.cube_version,
    )


def test_empty_strings_are_left_out_as_protobuf_leaves_them():
    answer = Answer(np.array([0.5], np.float32), "", "", "", "")
    assert predict_reply(answer) == _protobuf_bytes(answer) == b"\x0a\x04" + np.float32(0.5).tobytes()


def _instances(*kinds):
    request = serving_pb2.PredictRequest()
    for kind in kinds:
        inst = request.instances.add()
        if kind == "slots":
            inst.slots.slots[5].feasigns.append(1)
        elif kind is not None:
            inst.line = kind
    return request.instances


@pytest.mark.parametrize("lines", [[LINE], [LINE] * 32, [""], [LINE, ""], ["", LINE]])
def test_lines_stay_unparsed_even_an_empty_one(lines):
    parsed = parse_proto_instances(_instances(*lines), defer_lines=True)
    assert isinstance(parsed, UnparsedLines) and parsed.lines == lines


def test_slots_beside_lines_are_parsed_at_once():
    parsed = parse_proto_instances(_instances(LINE, "slots"), defer_lines=True)
    assert not isinstance(parsed, UnparsedLines) and parsed.n == 2


def test_an_instance_without_features_is_refused():
    with pytest.raises(InstanceError, match='instance 1 is empty: give "line" or "slots"'):
        parse_proto_instances(_instances(LINE, None), defer_lines=True)
