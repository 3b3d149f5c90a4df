"""history, rollback and the automated canary against real cube servers and agents, a real cube-transfer,
the real file server and serving, under a bounded loopback load (every request must succeed)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time

import pyarrow  # noqa: F401  (before paddle)

import pytest
import requests
from helpers_cube import TOKEN, cube_processes, fileserver, shard_specs
from helpers_serving import (  # noqa: F401  (served_fixture: the session's passes, fixture "served")
    copy_pass,
    free_port,
    golden,
    served_fixture,
    serving_in_thread,
    shift_output_logit,
)

from ctr_foundation.http_json import make_json_server
from ctr_foundation.http_server import serve_in_thread
from cube.rollout import RetryPolicy
from cube.transfer import Transfer, TransferConfig
from elastic_control.cli.rollouts import history_rows, rollback, transfer_history
from elastic_control.serving.canary import Canary, Criteria, ServingSplitApi
from elastic_control.serving.versions import FileServerSource

pytestmark = [pytest.mark.needs_criteo, pytest.mark.e2e]
P0, BAD, GOOD = "pass-20200101-10", "pass-20200101-11", "pass-20200101-09"


@pytest.fixture(scope="module")
def stack(served, tmp_path_factory):
    """GOOD (the session's pass), P0 (the same weights under another name) and BAD (P0 with its output logit
    +1) rolled out by cube-transfer in that order: every version a canary challenger can be is published."""
    root = tmp_path_factory.mktemp("rollouts-ops")
    models = root / "models"
    models.mkdir()
    good = copy_pass(served.a, models, GOOD, donefile=False)
    p0 = copy_pass(served.a, models, P0, donefile=False)
    bad = copy_pass(served.a, models, BAD, donefile=False)
    shift_output_logit(bad, 1.0)
    with contextlib.ExitStack() as stack:
        fs_url = stack.enter_context(fileserver(root / "fs"))
        started = stack.enter_context(cube_processes(shard_specs(root, 2, fs_url), root))
        servers, agents = [started[0][0], started[2][0]], [started[1][0], started[3][0]]
        cfg = TransferConfig(
            model_path=models,
            cube_root=root / "built",
            fileserver_url=fs_url,
            agents=agents,
            token=TOKEN,
            retry=RetryPolicy(attempts=2, backoff=0.1, timeout=60),
            poll_interval=0.3,
        )
        transfer = Transfer(cfg)
        for pass_dir in (good, p0):  # rolled out (so published) one after the other
            _append_done(models, pass_dir)
            assert transfer.poll_once() == pass_dir.name
        server = make_json_server(host="127.0.0.1", port=0, routes=transfer.routes(), token=TOKEN, name="t")
        serve_in_thread(server)
        loop = threading.Thread(target=transfer.run_forever, daemon=True)
        loop.start()
        source = FileServerSource(fs_url, root / "cache", servers, token=TOKEN)
        srv = stack.enter_context(serving_in_thread(source, token=TOKEN, pin_wait=60.0, poll_interval=0.2))
        _append_done(models, bad)
        _wait(lambda: srv.app.active_version == BAD, 120, "serving never followed BAD")
        try:
            yield {
                "transfer": transfer,
                "transfer_url": f"http://127.0.0.1:{server.server_address[1]}",
                "serving": srv,
                "lines": golden(served.a),
                "root": root,
            }
        finally:
            transfer.stopping = True
            transfer.wake.set()
            loop.join(30)
            server.shutdown()


def _append_done(models, pass_dir):
    from ctr_foundation.atomic import append_line_durably

    meta = json.loads((pass_dir / "meta.json").read_text())
    line = {"pass": pass_dir.name, "path": str(pass_dir), "window": meta.get("window", {}), "time": time.time()}
    append_line_durably(models / "donefile", json.dumps(line))


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextlib.contextmanager
def load(url: str, lines_probs, *, clients: int = 2, limit: int = 3000, feedback: bool = True):
    """``clients`` threads post 8-line requests (at most ``limit`` in all) and feed back clicks drawn from
    the champion's probabilities; yields {"answers": [...], "errors": [...]}."""
    lines, probs = lines_probs
    stop, out, lock = threading.Event(), {"answers": [], "errors": [], "sent": 0}, threading.Lock()

    def client(c):
        rng = random.Random(c)
        s = requests.Session()
        while not stop.is_set():
            with lock:
                if out["sent"] >= limit:
                    return
                out["sent"] += 1
            j = rng.randrange(len(lines) - 8)
            body = {"instances": [{"line": ln} for ln in lines[j : j + 8]], "routing_key": f"u{rng.random()}"}
            r = s.post(url + "/v1/predict", json=body, timeout=60)
            if r.status_code != 200:
                out["errors"].append(r.text)
                continue
            a = r.json()
            out["answers"].append(a["model_version"])
            if feedback:
                events = [
                    {"request_id": a["request_id"], "index": i, "click": int(rng.random() < probs[j + i])}
                    for i in range(8)
                ]
                s.post(url + "/v1/feedback", json={"events": events}, timeout=60)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    try:
        yield out
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_rollback_goes_back_through_the_two_phase_switch_with_zero_failed_requests(stack):
    srv = stack["serving"]
    with load(srv.url, stack["lines"], limit=400, feedback=False) as out:
        _wait(lambda: len(out["answers"]) > 50, 60, "no answers before the rollback")
        answer = rollback(stack["transfer_url"], TOKEN, None)
        assert answer["version"] == P0 and answer["from"] == BAD and answer["by"] == "rollback"
        _wait(lambda: srv.app.active_version == P0, 60, "serving never followed the rollback")
        _wait(lambda: out["answers"].count(P0) > 20, 60, "no answers from P0 after the rollback")
    assert out["errors"] == []
    assert out["sent"] <= 400
    rows = history_rows(transfer_history({"cube_root": stack["root"] / "built", "transfer": None}), [], [])
    assert [(r["version"], r["by"], r["result"]) for r in rows if r["result"] == "active"] == [
        (GOOD, "cube-transfer", "active"),
        (P0, "cube-transfer", "active"),
        (BAD, "cube-transfer", "active"),
        (P0, "rollback", "active"),
    ]
    assert all(isinstance(r["seconds"], float) for r in rows)
    # the loop does not roll BAD out again
    time.sleep(1.0)
    assert stack["transfer"].journal.active_version == P0


def test_history_and_rollback_on_kubernetes_go_through_the_api_servers_service_proxy(
    stack, tmp_path, monkeypatch, capsys
):
    """A Kubernetes plan: `history` and `rollback` reach cube-transfer and serving through the (fake) API
    server's Service proxy, which drops Authorization: the token travels in X-Elastic-Ctr-Authorization."""
    from helpers_kube import render_plan
    from helpers_kube_api import fake_cluster

    from elastic_control.cli import main

    srv = stack["serving"]
    with fake_cluster(tmp_path, monkeypatch) as api:
        state = tmp_path / "state"
        render_plan(state, token=TOKEN, trainers=1, pservers=1, cube_shards=2)
        api.service_backends[("default", "elastic-ctr-cube-transfer", "http")] = stack["transfer_url"]
        api.service_backends[("default", "elastic-ctr-serving", "http")] = srv.url

        def cli(*args):
            capsys.readouterr()
            with pytest.raises(SystemExit) as ended:
                main([*args, "-o", "json", "--state-dir", str(state)])
            assert ended.value.code == 0, capsys.readouterr()
            return json.loads(capsys.readouterr().out)

        before = cli("history")["rollouts"]
        assert [r["version"] for r in before if r["result"] == "active"][:3] == [GOOD, P0, BAD]
        with load(srv.url, stack["lines"], limit=400, feedback=False) as out:
            _wait(lambda: len(out["answers"]) > 50, 60, "no answers before the rollback")
            there = cli("rollback", GOOD)
            assert there["version"] == GOOD and there["serving_followed_s"] is not None
            back = cli("rollback", P0)
            assert back["version"] == P0 and back["from"] == GOOD and back["serving_followed_s"] is not None
        assert out["errors"] == []
        rows = cli("history")["rollouts"]
        assert [(r["version"], r["by"]) for r in rows if r["result"] == "active"][-2:] == [
            (GOOD, "rollback"),
            (P0, "rollback"),
        ]
        proxied = [(m, p) for m, p, _ in api.requests if "/proxy/" in p]
        assert ("POST", "/api/v1/namespaces/default/services/elastic-ctr-cube-transfer:http/proxy/v1/rollback") in [
            (m, p.replace("%3A", ":")) for m, p in proxied
        ]
    assert srv.app.active_version == P0  # as the tests after this one expect


def test_a_split_set_by_hand_gives_its_challenger_the_challenger_alias(stack, mlflow_server, monkeypatch):
    """PUT /v1/split (not only a canary) points MLflow's `challenger` alias at the challenger's registered
    version, through serving's split hook (elastic_control/serving/service.py), against a real MLflow."""
    from ctr_foundation.model_registry import CHALLENGER, alias_version
    from elastic_control.serving.service import challenger_alias
    from elastic_control.training.tracking import Tracker

    url, _ = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    models = stack["root"] / "models"
    tracker = Tracker(models, run_name="train", retry_for=30)
    window = {"start": "20200101/00", "end": "20200101/00"}
    versions = {p: tracker.register_pass(models / p, pass_name=p, window=window, metrics={}) for p in (GOOD, BAD)}
    hook = challenger_alias(url, patience=30)
    app = stack["serving"].app
    app.split_hooks.append(hook)
    try:
        api = ServingSplitApi(stack["serving"].url, TOKEN)
        api.put_split("challenger", BAD, 5.0)
        assert hook.setter.wait(60) and alias_version(url, CHALLENGER) == versions[BAD]
        api.put_split("challenger", GOOD, 5.0)
        assert hook.setter.wait(60) and alias_version(url, CHALLENGER) == versions[GOOD]
        api.abort()
    finally:
        app.split_hooks.remove(hook)
        tracker.finish()
    assert app.split.challengers == []


def _canary(stack, version, records):
    criteria = Criteria(
        calibration_band=(0.7, 1.4), max_logloss_rise=0.1, max_auc_drop=0.1, min_feedback=400, min_clicks=40
    )
    api = ServingSplitApi(stack["serving"].url, TOKEN)
    return Canary(
        api, version, ramp=(10.0, 50.0, 100.0), window_s=3.0, max_wait_s=60.0, poll_s=0.3,
        criteria=criteria, on_record=records.append,
    )  # fmt: skip


def test_a_bad_challenger_is_aborted_within_the_window_and_control_keeps_answering(stack):
    srv = stack["serving"]
    assert srv.app.active_version == P0
    records: list[dict] = []
    with load(srv.url, stack["lines"], limit=6000) as out:
        result = _canary(stack, BAD, records).run()
    assert result.outcome == "aborted", result
    assert "calibration" in result.reason
    assert [s["percent"] for s in result.steps] == [10.0]  # stopped at the first step
    assert result.steps[0]["seconds"] < 60.0
    assert out["errors"] == []
    assert srv.app.split.challengers == [] and srv.app.promotion is None
    assert [r["event"] for r in records] == ["started", "step", "verdict", "aborted"]
    rows = history_rows([], [], records)
    assert [r["result"] for r in rows] == ["canary started", "canary verdict", "canary aborted"]
    assert all(r["by"] == "split" for r in rows)


def test_a_good_challenger_is_promoted_to_everything(stack):
    srv = stack["serving"]
    records: list[dict] = []
    with load(srv.url, stack["lines"], limit=12000) as out:
        result = _canary(stack, GOOD, records).run()
        assert result.outcome == "promoted", (result, out["sent"])
        _wait(lambda: out["answers"][-1:] == [GOOD], 30, f"the promoted challenger does not answer ({out['sent']})")
    assert [(s["percent"], s["verdict"]) for s in result.steps] == [(p, "passed") for p in (10.0, 50.0, 100.0)]
    assert out["errors"] == []
    assert srv.app.promotion is not None and srv.app.promotion.version == GOOD
    assert records[-1]["event"] == "promoted"
    requests.delete(srv.url + "/v1/split", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
