"""Serving a pass with dense slots (slot.conf ``SLOT dense``, ctr_foundation/dense_features.py): every path
(HTTP lines and slots form, gRPC, the client, cube, shadow scoring) scores like the training program, and a
request the model cannot score is refused alone. The pass comes from the product: `elastic-control data
criteo` on real lines (I1-I13 also as numbers in slots 40-52), trained with the slot.conf it wrote."""

from __future__ import annotations

import json
import re
import threading

import pyarrow  # noqa: F401  (before paddle)

import grpc
import numpy as np
import pytest
import requests
from helpers_common import fileserver_in_thread
from helpers_passes import criteo_dense_world
from helpers_serving import copy_pass, cube_servers, golden, publish_version, serving_in_thread, slots_instance

from client.api import GrpcServingClient, ServingClient
from client.cli import main as client_main
from ctr_foundation.grpc_api import serving_pb2, serving_pb2_grpc
from ctr_foundation.pass_format import load_pass
from elastic_control.serving.batcher import Answer, Frontend, Job
from elastic_control.serving.instances import predict_request
from elastic_control.serving.versions import FileServerSource, ModelDirSource

pytestmark = pytest.mark.needs_criteo
TOL = 1e-5
DENSE_SLOTS = list(range(40, 53))


@pytest.fixture(scope="module")
def dense_world(tmp_path_factory):
    """One pass trained by `elastic-control train` with 39 sparse and 13 dense slots (~20 s)."""
    world = criteo_dense_world(tmp_path_factory.mktemp("dense-world"))
    assert load_pass(world.latest).dense_slots == DENSE_SLOTS
    return world


@pytest.fixture(scope="module")
def dense_golden(dense_world):
    lines, probs = golden(dense_world.latest)
    assert any(" 0.0:4" in ln for ln in lines) and any(" 1.09861:4" in ln for ln in lines), "value tokens"
    return lines, probs


def integer_dense_tokens(lines: list[str]) -> list[str]:
    """The lines with each ``0.0:SLOT`` value token written ``0:SLOT``: an integer token of a dense slot is
    that slot's value too (the slot's kind decides), so the probabilities must not change."""
    return [re.sub(r"(?<= )0\.0:(?=\d)", "0:", ln) for ln in lines]


@pytest.fixture(scope="module")
def served(dense_world):
    """Serving (HTTP and gRPC, one batch worker) of the dense pass, from its MODEL_PATH."""
    with serving_in_thread(ModelDirSource(dense_world.models), grpc=True, workers=1) as srv:
        yield srv


def test_golden_lines_through_http_grpc_and_the_client_in_both_forms(served, dense_golden, tmp_path, capsys):
    lines, probs = dense_golden
    status = requests.get(served.url + "/v1/status", timeout=10).json()
    assert status["dense_slots"] == DENSE_SLOTS
    as_integers = integer_dense_tokens(lines)
    assert as_integers != lines
    for name, instances in (
        ("lines", [{"line": ln} for ln in lines]),
        ("slots", [slots_instance(ln) for ln in lines]),
        ("integer tokens of dense slots", [{"line": ln} for ln in as_integers]),
        ("integers for dense slots", [slots_instance(ln) for ln in as_integers]),
    ):
        r = requests.post(served.url + "/v1/predict", json={"instances": instances}, timeout=60)
        assert r.status_code == 200, (name, r.text)
        np.testing.assert_allclose(r.json()["predictions"], probs, rtol=0, atol=TOL, err_msg=f"HTTP {name}")
    http, rpc = ServingClient(served.url), GrpcServingClient(served.grpc_target)
    try:
        for name, got in (
            ("HTTP client lines", list(http.predict_lines(lines, batch_size=16))),
            ("gRPC client lines", list(rpc.predict_lines(lines, batch_size=16))),
            # floats go to SlotFeatures.dense, integers (Criteo's 0:40 tokens) stay feasigns
            ("gRPC slots form", rpc.predict_instances([slots_instance(ln) for ln in lines])["predictions"]),
            ("gRPC integers", rpc.predict_instances([slots_instance(ln) for ln in as_integers])["predictions"]),
        ):
            np.testing.assert_allclose(got, probs, rtol=0, atol=TOL, err_msg=name)
    finally:
        rpc.close()
    # `ctr-client predict FILE` over both transports: the lines go as they are, value tokens included
    (tmp_path / "golden.txt").write_text("\n".join(lines) + "\n")
    for transport in ("http", "grpc"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            client_main(
                ["predict", str(tmp_path / "golden.txt"), "--transport", transport, "--serving", served.url]
                + ["--grpc", served.grpc_target, "--state-dir", str(tmp_path)]
            )
        assert done.value.code == 0
        got = [float(x) for x in capsys.readouterr().out.split()]
        np.testing.assert_allclose(got, probs, rtol=0, atol=TOL, err_msg=f"ctr-client predict over {transport}")
    # no number at all for the dense slots: missing values, standardised to 0 (the mean), as in training
    r = requests.post(served.url + "/v1/predict", json={"instances": [{"slots": {"1": [1]}}]}, timeout=30)
    assert r.status_code == 200 and 0 < r.json()["predictions"][0] < 1


@pytest.mark.parametrize(
    "instance, words",
    [
        ({"slots": {"40": "abc"}}, "instance 0 slot 40: feasign 'abc' is not an unsigned integer"),
        ({"slots": {"40": True}}, "instance 0 slot 40: True is not an integer feasign nor a number"),
        ({"line": "1 0 1:1 1e999:40"}, "a dense value must be a finite decimal number"),
        ({"line": "1 0 1:1 2.5e:40"}, "'2.5e:40' is not integer:integer (feasign:slot) nor number:integer"),
        ({"slots": {"40": [1, 2.5]}}, "instance 0 slot 40: a dense slot takes one number, got 2"),
        ({"slots": {"14": [2.5]}}, "instance 0 slot 14: feasign 2.5 is not an integer (slot 14 is sparse"),
        ({"slots": {"99": 2.5}}, "instance 0: unknown slot '99'"),
    ],
)
def test_a_bad_dense_value_is_a_400_and_serving_keeps_serving(served, dense_golden, instance, words):
    lines, probs = dense_golden
    r = requests.post(served.url + "/v1/predict", json={"instances": [instance]}, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"], r.text
    ok = requests.post(served.url + "/v1/predict", json={"instances": [{"line": lines[0]}]}, timeout=30)
    assert ok.status_code == 200 and abs(ok.json()["predictions"][0] - probs[0]) < TOL


def test_bad_dense_values_over_grpc_are_invalid_argument(served):
    pb = serving_pb2
    cases = [
        (pb.SlotFeatures(dense={40: float("nan")}), "instance 0 slot 40: dense value nan is not a finite number"),
        (pb.SlotFeatures(dense={14: 2.5}), "instance 0 slot 14: feasign 2.5 is not an integer"),
        (
            pb.SlotFeatures(slots={40: pb.FeasignList(feasigns=[1])}, dense={40: 2.5}),
            "instance 0 slot 40: a dense slot takes one number, got 2",
        ),
    ]
    with grpc.insecure_channel(served.grpc_target) as ch:
        stub = serving_pb2_grpc.PredictionStub(ch)
        for features, words in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.Predict(pb.PredictRequest(instances=[pb.Instance(slots=features)]), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), words
        # an old client's message (no dense field) still scores: its dense slots are missing
        old = pb.SlotFeatures(slots={1: pb.FeasignList(feasigns=[7])})
        assert len(stub.Predict(pb.PredictRequest(instances=[pb.Instance(slots=old)]), timeout=30).probabilities) == 1


class _Collect(Frontend):
    """Where the batcher's answers go in this test: {request number: outcome}."""

    name = "test"

    def __init__(self, expected: int):
        self.outcomes: dict[int, object] = {}
        self.expected = expected
        self.done = threading.Event()

    def deliver(self, items):
        for job, outcome in items:
            self.outcomes[job.context] = outcome
        if len(self.outcomes) == self.expected:
            self.done.set()


def test_in_one_merged_batch_a_bad_request_is_refused_alone(served, dense_golden):
    """Requests queued together form one batch; the two the model cannot score (two numbers for a dense
    slot; a number for a sparse slot, in a request's second instance) get their 400, the others their rows."""
    lines, probs = dense_golden
    bodies = [
        {"instances": [{"line": ln} for ln in lines[:3]]},
        {"instances": [{"slots": {"1": [5], "40": [1.5, 2]}}]},
        {"instances": [slots_instance(lines[3]), {"slots": {"1": [2.5]}}]},
        {"instances": [slots_instance(ln) for ln in lines[4:6]]},
    ]
    frontend = _Collect(len(bodies))
    batcher = served.app.batcher
    before = served.app.metrics.snapshot()["batches"]
    batcher.submit_many([Job(predict_request(b), frontend, i) for i, b in enumerate(bodies)])
    assert frontend.done.wait(30)
    assert served.app.metrics.snapshot()["batches"] == before + 1, "the four requests were one batch"
    good = {0: probs[:3], 3: probs[4:6]}
    for i, want in good.items():
        assert isinstance(frontend.outcomes[i], Answer), frontend.outcomes[i]
        np.testing.assert_allclose(frontend.outcomes[i].probabilities, want, rtol=0, atol=TOL)
    assert frontend.outcomes[1].status == 400
    assert frontend.outcomes[1].message == "instance 0 slot 40: a dense slot takes one number, got 2"
    assert frontend.outcomes[2].status == 400
    assert frontend.outcomes[2].message.startswith("instance 1 slot 1: feasign 2.5 is not an integer")


def test_one_batch_across_arms_with_and_without_dense_slots(dense_world, criteo_world, dense_golden, tmp_path):
    """An A/B split between the dense pass (control) and a pass without dense slots: requests of both arms
    queued together are scored each by its own version (its own input width), each equal to its golden;
    a dense value sent to the arm whose model has no dense slots is refused, alone."""
    models = tmp_path / "models"
    plain = copy_pass(criteo_world.latest, models, "pass-20200101-00")
    copy_pass(dense_world.latest, models, "pass-20200101-01")
    assert load_pass(plain).dense_slots == [] and load_pass(plain).dense_norm is None
    lines, probs = dense_golden
    plain_lines, plain_probs = golden(plain)
    token = "s3cret"
    with serving_in_thread(ModelDirSource(models), token=token, workers=1) as srv:
        arms = [{"name": "control", "weight": 50}, {"name": "plain", "version": plain.name, "weight": 50}]
        r = requests.put(
            srv.url + "/v1/split", json={"arms": arms}, headers={"Authorization": f"Bearer {token}"}, timeout=120
        )
        assert r.status_code == 200, r.text
        bodies = [
            {"instances": [{"line": ln} for ln in lines[:20]], "arm": "control"},
            {"instances": [{"line": ln} for ln in plain_lines[:20]], "arm": "plain"},
            {"instances": [slots_instance(ln) for ln in lines[20:30]], "arm": "control"},
            {"instances": [slots_instance(lines[0])], "arm": "plain"},  # slots 40-52 are not the plain model's
        ]
        frontend = _Collect(len(bodies))
        srv.app.batcher.submit_many([Job(predict_request(b), frontend, i) for i, b in enumerate(bodies)])
        assert frontend.done.wait(30)
    out = frontend.outcomes
    for i, (version, want) in {0: ("pass-20200101-01", probs[:20]), 1: (plain.name, plain_probs[:20])}.items():
        assert isinstance(out[i], Answer) and out[i].model_version == version, out[i]
        np.testing.assert_allclose(out[i].probabilities, want, rtol=0, atol=TOL)
    np.testing.assert_allclose(out[2].probabilities, probs[20:30], rtol=0, atol=TOL)
    assert out[3].status == 400 and out[3].message.startswith("instance 0: unknown slot '40'"), out[3]


def test_golden_lines_through_cube_and_the_file_server(dense_world, dense_golden, tmp_path):
    """cube-transfer's copy of meta.json (dense_slots, dense_norm) is what serving standardises with."""
    lines, probs = dense_golden
    fs_root = tmp_path / "fs"
    publish_version(fs_root, dense_world.latest, shards=2)
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        with serving_in_thread(FileServerSource(fs_url, tmp_path / "cache", urls)) as srv:
            assert srv.app.active.dense_slots == tuple(DENSE_SLOTS) and srv.app.active.dense_norm is not None
            body = {"instances": [{"line": ln} for ln in lines[:50]] + [slots_instance(ln) for ln in lines[50:]]}
            r = requests.post(srv.url + "/v1/predict", data=json.dumps(body), timeout=60)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["predictions"], probs, rtol=0, atol=TOL)


def test_shadow_scoring_of_a_candidate_with_dense_slots(dense_world, dense_golden, tmp_path):
    from elastic_control.evaluation.shadow import ShadowScorer

    lines, probs = dense_golden
    shadow = ShadowScorer(dense_world.latest, tmp_path / "shadow.jsonl")
    try:
        got = shadow.score_instances([{"line": ln} for ln in lines[:50]] + [slots_instance(ln) for ln in lines[50:]])
    finally:
        shadow.close()
    np.testing.assert_allclose(got, probs, rtol=0, atol=TOL)
