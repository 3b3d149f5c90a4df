"""Serving as users drive it: gRPC beside HTTP, A/B splits, click feedback and live metrics,
the hot-key cache; real passes, real HTTP and gRPC servers on loopback."""

from __future__ import annotations

import math
import time

import pyarrow  # noqa: F401  (before paddle)

import grpc
import numpy as np
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers_serving import (  # noqa: F401  (fixture "served")
    golden,
    predicting_clients,
    served_fixture,
    serving_in_thread,
)

from ctr_foundation.grpc_api import SERVICE, serving_pb2, serving_pb2_grpc
from elastic_control.serving.versions import ModelDirSource

pytestmark = pytest.mark.needs_criteo  # the session's passes are trained on real Criteo lines
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def predict(url, lines, **extra):
    r = requests.post(url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines], **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def put_split(url, arms, headers=AUTH):
    return requests.put(url + "/v1/split", json={"arms": arms}, headers=headers, timeout=120)


# ---- gRPC ---------------------------------------------------------------------------------------


def test_grpc_health_reflection_and_predict_match_http(served, tmp_path):
    lines, probs = golden(served.a)
    with serving_in_thread(ModelDirSource(tmp_path), wait_ready=False, grpc=True) as empty:
        with grpc.insecure_channel(empty.grpc_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # the health service answers before any model is loaded: NOT_SERVING
            status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = serving_pb2_grpc.PredictionStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Predict(serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line=lines[0])]), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no model version" in e.value.details()

    with serving_in_thread(ModelDirSource(served.models), grpc=True) as srv:
        with grpc.insecure_channel(srv.grpc_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status != 1:
                assert time.monotonic() < deadline, "gRPC health never said SERVING"
                time.sleep(0.1)
            assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == 1  # SERVING

            services = _reflected_services(ch)
            assert SERVICE in services and "grpc.health.v1.Health" in services

            stub = serving_pb2_grpc.PredictionStub(ch)
            g = stub.Predict(serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line=ln) for ln in lines]))
            h = predict(srv.url, lines)
            np.testing.assert_allclose(g.probabilities, h["predictions"], rtol=0, atol=1e-6)
            np.testing.assert_allclose(g.probabilities, probs, rtol=0, atol=1e-5)  # golden lines through gRPC
            assert (g.model_version, g.cube_version, g.arm) == (h["model_version"], h["cube_version"], h["arm"])
            assert g.request_id and g.request_id != h["request_id"]

            # the slots form: uint64 feasigns natively
            slots = serving_pb2.SlotFeatures(slots={1: serving_pb2.FeasignList(feasigns=[2**64 - 1, 5])})
            assert (
                len(
                    stub.Predict(
                        serving_pb2.PredictRequest(instances=[serving_pb2.Instance(slots=slots)])
                    ).probabilities
                )
                == 1
            )
            for request, code, words in (
                (
                    serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line="1 0 ²:1")]),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "ASCII digits",
                ),
                (serving_pb2.PredictRequest(), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
                (
                    serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line="1 0 1:1")] * 10_001),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "at most 10000",
                ),
                (
                    serving_pb2.PredictRequest(
                        instances=[
                            serving_pb2.Instance(
                                slots=serving_pb2.SlotFeatures(slots={999: serving_pb2.FeasignList(feasigns=[1])})
                            )
                        ]
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "unknown slot '999'",
                ),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Predict(request, timeout=30)
                assert e.value.code() == code and words in e.value.details(), e.value.details()

            fb = stub.Feedback(
                serving_pb2.FeedbackRequest(
                    events=[
                        serving_pb2.FeedbackEvent(request_id=g.request_id, index=0, click=1),
                        serving_pb2.FeedbackEvent(request_id=g.request_id, index=0, click=1),
                        serving_pb2.FeedbackEvent(request_id=h["request_id"], index=len(lines), click=0),
                        serving_pb2.FeedbackEvent(request_id="nope", index=0, click=0),
                    ]
                )
            )
            assert (fb.joined, fb.duplicate, fb.invalid, fb.unknown) == (1, 1, 1, 1)


def _reflected_services(channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    return {s.name for a in answers for s in a.list_services_response.service}


# ---- A/B splits -----------------------------------------------------------------------------------


def test_split_90_10_routes_2000_keys_within_3_percent_stably_and_ends_in_one_call(served):
    lines, _ = golden(served.a)
    control_v, challenger_v = served.control.name, served.miscalibrated.name
    with serving_in_thread(ModelDirSource(served.models), token=TOKEN) as srv:
        url = srv.url
        arms = [{"name": "control", "weight": 90}, {"name": "challenger", "version": challenger_v, "weight": 10}]
        assert put_split(url, arms, headers={}).status_code == 401
        assert put_split(url, arms, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert (
            put_split(
                url,
                [{"name": "challenger", "version": "pass-29990101-00", "weight": 1}, {"name": "control", "weight": 1}],
            ).status_code
            == 409
        )  # no such version
        r = put_split(url, arms)
        assert r.status_code == 200, r.text
        assert requests.get(url + "/v1/split").json()["split"]["weights"] == {"control": 0.9, "challenger": 0.1}

        loaded = {("control", control_v), ("challenger", challenger_v)}
        first = {}
        s = requests.Session()
        for i in range(2000):
            a = s.post(url + "/v1/predict", json={"instances": [{"line": lines[i % 50]}], "routing_key": f"user-{i}"})
            a = a.json()
            assert (a["arm"], a["model_version"]) in loaded and a["model_version"] == a["cube_version"]
            first[i] = a["arm"]
        share = sum(1 for v in first.values() if v == "challenger") / 2000
        assert abs(share - 0.10) <= 0.03, share
        for i in range(0, 2000, 7):  # repeated calls: each key keeps its arm
            a = s.post(url + "/v1/predict", json={"instances": [{"line": lines[3]}], "routing_key": f"user-{i}"})
            assert a.json()["arm"] == first[i]
        no_key = [predict(url, lines[:1])["arm"] for _ in range(300)]
        assert 0.03 <= no_key.count("challenger") / 300 <= 0.2  # without a key: random with the weights

        monitor = requests.get(url + "/v1/monitor").json()
        counts = {(x["arm"], x["version"]): x["predictions"]["count"] for x in monitor["series"]}
        assert counts[("challenger", challenger_v)] >= sum(1 for v in first.values() if v == "challenger")

        # ending the split is one call: promote the challenger ...
        r = requests.post(url + "/v1/split/end", json={"winner": "challenger"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == challenger_v, r.text
        assert {predict(url, lines[:1], routing_key=f"user-{i}")["model_version"] for i in range(20)} == {challenger_v}
        # ... or drop every challenger
        assert put_split(url, arms).status_code == 200
        assert requests.delete(url + "/v1/split", headers=AUTH).status_code == 200
        got = {(predict(url, lines[:1], routing_key=f"user-{i}")["arm"]) for i in range(50)}
        assert got == {"control"}


def test_no_failed_request_while_the_split_changes_under_load(served):
    lines, _ = golden(served.a)
    control_v, challenger_v = served.control.name, served.miscalibrated.name
    with serving_in_thread(ModelDirSource(served.models), token=TOKEN) as srv:
        url = srv.url

        def request(i, k):
            return i, {"instances": [{"line": ln} for ln in lines[i : i + 4]], "routing_key": f"c{i}-{k % 37}"}

        with predicting_clients(url, request, clients=6) as (answered, errors):
            for arms in (
                [{"name": "control", "weight": 50}, {"name": "challenger", "version": challenger_v, "weight": 50}],
                [{"name": "control", "weight": 80}, {"name": "b", "version": challenger_v, "weight": 20}],
                [{"name": "control", "weight": 0}, {"name": "b", "version": challenger_v, "weight": 1}],
            ):
                time.sleep(0.7)
                assert put_split(url, arms).status_code == 200
            time.sleep(0.7)
            assert requests.post(url + "/v1/split/end", json={"winner": "b"}, headers=AUTH).status_code == 200
            time.sleep(0.7)
            assert requests.delete(url + "/v1/split", headers=AUTH).status_code == 200
            time.sleep(0.7)
    answers = [a for _, a in answered]
    assert errors == []
    pairs = {(a["arm"], a["model_version"]) for a in answers}
    assert pairs <= {("control", control_v), ("challenger", challenger_v), ("b", challenger_v)}
    assert {p[1] for p in pairs} == {control_v, challenger_v}


# ---- feedback and live metrics ------------------------------------------------------------------------


def _logit(p):
    return math.log(p) - math.log1p(-p)


def test_feedback_metrics_match_a_recomputation_and_the_miscalibrated_arm_alerts(served):
    """Clicks drawn from the true model (pass A): the control arm serves A, the challenger serves A with its
    output logit shifted by +1.5; after a few thousand predictions fed back, /metrics and /v1/monitor show
    per-arm counts, observed CTR and calibration equal to a recomputation, and the challenger's calibration
    alert fires (the control's does not)."""
    lines, _ = golden(served.a)
    challenger_v = served.miscalibrated.name
    rng = np.random.default_rng(11)
    with serving_in_thread(ModelDirSource(served.models), token=TOKEN) as srv:
        url = srv.url
        arms = [{"name": "control", "weight": 50}, {"name": "challenger", "version": challenger_v, "weight": 50}]
        assert put_split(url, arms).status_code == 200
        events, mine = [], {"control": [], "challenger": []}
        s = requests.Session()
        for i in range(300):  # 300 requests x 10 instances = 3,000 predictions
            batch = [{"line": lines[(i * 10 + j) % len(lines)]} for j in range(10)]
            a = s.post(url + "/v1/predict", json={"instances": batch, "routing_key": f"u{i}"}).json()
            for j, p in enumerate(a["predictions"]):
                true_p = p if a["arm"] == "control" else 1 / (1 + math.exp(-(_logit(p) - 1.5)))
                click = int(rng.random() < true_p)
                events.append({"request_id": a["request_id"], "index": j, "click": click})
                mine[a["arm"]].append((p, click))
        for k in range(0, len(events), 1000):
            r = s.post(url + "/v1/feedback", json={"events": events[k : k + 1000]})
            assert r.status_code == 200 and r.json()["joined"] == len(events[k : k + 1000]), r.text
        assert s.post(url + "/v1/feedback", json={"events": events[:5]}).json()["duplicate"] == 5

        monitor = s.get(url + "/v1/monitor").json()
        metrics = s.get(url + "/metrics").text
        series = {x["arm"]: x for x in monitor["series"]}
        for arm, pairs in mine.items():
            p = np.array([x for x, _ in pairs])
            y = np.array([c for _, c in pairs])
            fb = series[arm]["feedback"]
            assert fb["count"] == len(pairs) and fb["clicks"] == int(y.sum())
            assert fb["observed_ctr"] == pytest.approx(y.mean(), rel=1e-12)
            assert fb["calibration"] == pytest.approx(p.mean() / y.mean(), rel=1e-6)
            version = series[arm]["version"]
            labels = f'arm="{arm}",version="{version}"'
            assert f"serving_arm_window_feedback{{{labels}}} {len(pairs)}" in metrics
            assert _gauge(metrics, "serving_arm_window_observed_ctr", labels) == pytest.approx(y.mean(), rel=1e-9)
            assert _gauge(metrics, "serving_arm_window_calibration", labels) == pytest.approx(
                p.mean() / y.mean(), rel=1e-6
            )
        assert 0.8 <= series["control"]["feedback"]["calibration"] <= 1.25
        assert series["challenger"]["feedback"]["calibration"] > 1.25
        alerts = [(a["kind"], a["arm"]) for a in monitor["alerts"] if a["kind"] == "calibration"]
        assert alerts == [("calibration", "challenger")]
        assert f'serving_alert{{kind="calibration",arm="challenger",version="{challenger_v}"}} 1' in metrics
        status = s.get(url + "/v1/status").json()
        assert {a["name"] for a in status["arms"]} == {"control", "challenger"}
        shown = _status_as_elastic_control_shows_it(srv)
    # `elastic-control status --json` and `status`: the same per-arm figures, probed from the live server.
    js = {x["arm"]: x for x in shown["json"]["serving"]["live"]["series"]}
    assert any("serving monitor" in a and "challenger" in a for a in shown["json"]["alerts"]), shown["json"]["alerts"]
    rows = {r[0]: r for r in shown["table"]}
    for arm, pairs in mine.items():
        p = np.array([x for x, _ in pairs])
        y = np.array([c for _, c in pairs])
        assert js[arm]["feedback"]["count"] == len(pairs) and js[arm]["feedback"]["clicks"] == int(y.sum())
        assert js[arm]["feedback"]["calibration"] == pytest.approx(p.mean() / y.mean(), rel=1e-6)
        # arm, version, predictions, mean prediction, feedback, clicks, observed CTR, calibration, ...
        row = rows[arm]
        assert int(row[4]) == len(pairs) and int(row[5]) == int(y.sum())
        assert float(row[6]) == pytest.approx(y.mean(), rel=1e-5)
        assert float(row[7]) == pytest.approx(p.mean() / y.mean(), rel=1e-5)


def _status_as_elastic_control_shows_it(srv) -> dict:
    """The local backend's status of this serving process: its probe (/readyz, /v1/status, /v1/monitor), the
    serving section built from it, then the status views (`status --json` and the tables of `status`)."""
    import contextlib
    import io
    import json as _json
    import os

    from elastic_control.backends import status as st
    from elastic_control.cli import status_view
    from elastic_control.local import status as local_status
    from elastic_control.local.health import probe_component
    from elastic_control.local.spec import ComponentSpec, LocalPlan

    spec = ComponentSpec(name="serving", kind="serving", argv=["serve"], port=srv.port)
    probe = probe_component(spec, os.getpid())
    row = st.ComponentStatus(name="serving", kind="serving", state=st.RUNNING)
    plan = LocalPlan(components=[spec], serving_url=srv.url)
    status = st.PipelineStatus(backend="local", state_dir="-", target="local processes", state=st.RUNNING)
    status.components = [row]
    status.serving = local_status._serving(plan, [row], {"serving": probe}, {})
    status.alerts = local_status._alerts(status)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status_view.print_status_json(status)
    doc = _json.loads(out.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status_view.print_status(status)
    text = out.getvalue()
    assert "serving live metrics" in text, text
    table = [ln.replace("│", " ").split() for ln in text.split("serving live metrics", 1)[1].splitlines()]
    return {"json": doc, "table": [r for r in table if r and r[0] in ("control", "challenger")]}


def _gauge(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


# ---- the hot-key cache -------------------------------------------------------------------------------


def test_cache_answers_equal_uncached_ones_and_its_hit_rate_is_exported(served):
    lines, probs = golden(served.a)
    with serving_in_thread(ModelDirSource(served.models), cache_entries=0) as plain:
        uncached = predict(plain.url, lines)["predictions"]
        assert "serving_cache_hits_total" not in requests.get(plain.url + "/metrics").text
    with serving_in_thread(ModelDirSource(served.models), cache_entries=1 << 16) as srv:
        cold = predict(srv.url, lines)["predictions"]
        warm = predict(srv.url, lines)["predictions"]
        metrics = requests.get(srv.url + "/metrics").text
    np.testing.assert_allclose(cold, uncached, rtol=0, atol=1e-6)
    np.testing.assert_allclose(warm, uncached, rtol=0, atol=1e-6)
    np.testing.assert_allclose(warm, probs, rtol=0, atol=1e-5)
    hits = _plain(metrics, "serving_cache_hits_total")
    lookups = _plain(metrics, "serving_cache_lookups_total")
    assert lookups > 0 and hits >= 0.97 * lookups / 2  # the second pass over the same lines: (nearly) all hits
    assert 0 < _plain(metrics, "serving_cache_hit_rate") <= 1


def _plain(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_client_over_both_transports_and_the_ab_report(served):
    import json
    import subprocess

    from helpers_serving import PYTHON

    from client.api import GrpcServingClient, PredictionError, ServingClient

    lines, probs = golden(served.a)
    challenger_v = served.miscalibrated.name
    with serving_in_thread(ModelDirSource(served.models), grpc=True, token=TOKEN) as srv:
        http, rpc = ServingClient(srv.url), GrpcServingClient(srv.grpc_target)
        via_http = list(http.predict_lines(lines, batch_size=32))
        via_grpc = list(rpc.predict_lines(lines, batch_size=32))
        np.testing.assert_allclose(via_grpc, via_http, rtol=0, atol=1e-6)
        np.testing.assert_allclose(via_grpc, probs, rtol=0, atol=1e-5)
        assert rpc.health() == "SERVING", srv.app.readiness()
        with pytest.raises(PredictionError, match="INVALID_ARGUMENT"):
            rpc.predict_instances([{"line": "1 0 ²:1"}])
        arms = [{"name": "control", "weight": 50}, {"name": "challenger", "version": challenger_v, "weight": 50}]
        assert put_split(srv.url, arms).status_code == 200
        rng = np.random.default_rng(5)
        for i in range(200):
            client = http if i % 2 else rpc
            a = client.predict_instances([{"line": ln} for ln in lines[:5]], routing_key=f"r{i}")
            events = [{"request_id": a["request_id"], "index": j, "click": int(rng.random() < 0.3)} for j in range(5)]
            assert client.feedback(events)["joined"] == 5
        rpc.close()
        out = subprocess.run(
            [PYTHON, "-m", "elastic_control", "ab-report", "--serving", srv.url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert {a["arm"] for a in report["arms"]} == {"control", "challenger"}
        assert sum(a["feedback"] for a in report["arms"]) == 1000
        (cmp,) = report["comparisons"]
        for key in ("ctr", "calibration", "logloss", "auc"):
            lo, hi = cmp[key]["ci"]
            assert lo <= cmp[key]["difference"] <= hi
        text = subprocess.run(
            [PYTHON, "-m", "elastic_control", "ab-report", "--serving", srv.url],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert "challenger - control" in text and "calibration" not in text.splitlines()[0]
