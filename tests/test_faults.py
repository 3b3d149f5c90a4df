"""Fault suite: every component a real process, faults injected from outside.

kill -9 and SIGSTOP of each component (cube-server, cube-agent, cube-transfer, the file server), shard
files truncated and overwritten (active and non-active versions, pinned, before load and while loaded,
on the file server and on a shard), a disk filling up during a rollout (tmpfs, root only). What must
hold throughout: every answer is exact (each pass's embeddings all equal one value, so any mix-up or
garbage shows) or a clear error; a rollout never leaves shards on different versions; health probes
say what is wrong (stopped = hung, killed = missing, nothing loaded = not ready); after the fault
is lifted the pipeline heals by itself (agents re-seed, cube-transfer retries).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time

import numpy as np
import pytest
import requests
from helpers_common import wait_until
from helpers_faults import AUTH, Pipeline, tmpfs

from elastic_control.backends import status as st
from elastic_control.local.health import probe_component
from elastic_control.local.spec import ComponentSpec

pytestmark = pytest.mark.e2e
KEYS = np.unique(np.random.default_rng(15).integers(1, 2**64 - 1, 3000, dtype=np.uint64))


@pytest.fixture
def pipe(tmp_path):
    p = Pipeline(tmp_path, KEYS)
    try:
        yield p.start()
    finally:
        p.close()


def probe(component, kind: str) -> str:
    port = int(component.url.rsplit(":", 1)[1]) if component.url else None
    spec = ComponentSpec(name=component.name, kind=kind, port=port, ready="http:/healthz", argv=["x"])
    pid = component.proc.pid if component.proc is not None and component.proc.poll() is None else None
    return probe_component(spec, pid, timeout=1.0).state


def readyz(url: str) -> int | None:
    try:
        return requests.get(f"{url}/readyz", timeout=2).status_code
    except requests.RequestException:
        return None


def wait_failed(pipe: Pipeline, version: str, timeout: float = 60) -> dict:
    """Until cube-transfer records ``version`` as failed; its journal entry."""

    def failed():
        entry = pipe.transfer_status()["passes"].get(version, {})
        return entry if entry.get("status") == "failed" else None

    return wait_until(failed, timeout, 0.2, f"cube-transfer to record {version} as failed")


def test_kill9_and_sigstop_of_cube_servers_give_clear_errors_and_heal(pipe):
    v1 = pipe.roll_out(1.0)
    server = pipe.servers[1]
    with server.stopped():
        # A stopped shard: lookups time out with an error naming the shard; status calls it hung.
        answer = pipe.answer_or_clear_error(timeout=1.5)
        assert answer.startswith("error") and server.url in answer, answer
        assert probe(server, "cube-server") == st.HUNG
        assert pipe.answer_or_clear_error(v1, timeout=1.5).startswith("error")
    assert pipe.check_exact() == v1
    server.kill9()
    answer = pipe.answer_or_clear_error(timeout=1.5)
    assert answer.startswith("error") and server.url in answer, answer
    assert probe(server, "cube-server") == st.MISSING
    server.start()  # back on its port and its files: the same version, verified, ready
    assert readyz(server.url) == 200
    assert pipe.check_exact() == v1 and pipe.actives() == [v1, v1]
    # A rollout while a server is stopped never activates anywhere; once resumed it completes.
    with server.stopped():
        v2 = pipe.add_pass(2.0)
        wait_failed(pipe, v2)
        assert pipe.server_status(0)["active"] == v1
        assert pipe.answer_or_clear_error(v1, timeout=1.5).startswith("error")  # shard 1 is stopped
    assert pipe.check_exact() in (v1, v2)  # cube-transfer's retry may have come already
    pipe.wait_active(v2, 60)  # cube-transfer retries (5 s backoff)
    assert pipe.check_exact() == v2 and pipe.check_exact(v1) == v1  # the previous version stays exact


def test_kill9_and_sigstop_of_agents_and_cube_transfer_never_split_a_rollout(pipe):
    v1 = pipe.roll_out(1.0)
    # A stopped agent holds the rollout in its prepare phase; cube-transfer is killed -9 there.
    agent = pipe.agents[0]
    with agent.stopped():
        assert probe(agent, "cube-agent") == st.HUNG
        v2 = pipe.add_pass(2.0)
        wait_until(lambda: pipe.transfer_status()["in_flight"], 20, 0.1, "a rollout in flight")
        pipe.transfer.kill9()
        assert pipe.actives() == [v1, v1] and pipe.check_exact() == v1
    pipe.transfer.start()  # recovers the interrupted rollout from its journal
    pipe.wait_active(v2, 60)
    assert pipe.check_exact() == v2
    # A killed agent: the rollout fails cleanly (both shards stay), the restarted agent takes the next try.
    pipe.agents[1].kill9()
    assert probe(pipe.agents[1], "cube-agent") == st.MISSING
    v3 = pipe.add_pass(3.0)
    entry = wait_failed(pipe, v3)
    assert str(pipe.agent_ports[1]) in entry["reason"] or "agent" in entry["reason"], entry
    assert pipe.actives() == [v2, v2] and pipe.check_exact() == v2
    pipe.agents[1].start()
    pipe.wait_active(v3, 60)
    assert pipe.check_exact() == v3
    # A stopped cube-transfer: status calls it hung, the shards serve on.
    with pipe.transfer.stopped():
        assert probe(pipe.transfer, "cube-transfer") == st.HUNG
        assert pipe.check_exact() == v3


@pytest.mark.slow
def test_file_server_kill9_and_sigstop_during_rollouts(pipe):
    v1 = pipe.roll_out(1.0)
    current = pipe.fs_root / "cube" / "current.json"
    assert json.loads(current.read_text())["version"] == v1
    fs = pipe.fileserver
    fs.kill9()
    assert probe(fs, "fileserver") == st.MISSING
    v2 = pipe.add_pass(2.0)
    entry = wait_failed(pipe, v2)
    assert "publish" in entry["reason"] or "file server" in entry["reason"], entry
    assert pipe.actives() == [v1, v1] and pipe.check_exact() == v1
    assert json.loads(current.read_text())["version"] == v1
    fs.start()
    pipe.wait_active(v2, 60)
    # current.json is published right after the shards switch.
    wait_until(lambda: json.loads(current.read_text())["version"] == v2, 20, 0.1, "current.json naming v2")
    assert pipe.check_exact() == v2
    with fs.stopped():
        assert probe(fs, "fileserver") == st.HUNG
        v3 = pipe.add_pass(3.0)
        wait_failed(pipe, v3, 90)
        assert pipe.actives() == [v2, v2] and pipe.check_exact() == v2
    pipe.wait_active(v3, 60)
    assert pipe.check_exact() == v3


def _overwrite_middle(path) -> None:
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 2048)


def test_damaged_shards_of_active_pinned_and_published_versions(pipe):
    v1 = pipe.roll_out(1.0)
    v2 = pipe.roll_out(2.0)
    # Pin v1 (as serving's A/B arm does): every shard loads it pinned.
    pins = {"versions": [v1]}
    requests.put(f"{pipe.fileserver.url}/files/cube/pins.json", json=pins, headers=AUTH, timeout=5).raise_for_status()
    wait_until(lambda: all(v1 in pipe.server_status(i).get("pinned", []) for i in range(2)), 30, 0.2, "v1 pinned")
    # While loaded: truncate the pinned version's file, overwrite the active one's: answers stay exact.
    pinned_file = pipe.data[0] / v1 / "shard-0.arrow"
    with open(pinned_file, "r+b") as f:
        f.truncate(pinned_file.stat().st_size // 2)
    _overwrite_middle(pipe.data[1] / v2 / "shard-1.arrow")
    assert pipe.check_exact(v1) == v1 and pipe.check_exact() == v2
    # Restarted on the damaged files (before load): both are refused by size/sha256, never served.
    for server in pipe.servers:
        server.restart()
    st0, st1 = pipe.server_status(0), pipe.server_status(1)
    # (agent-0 may have re-loaded the pin from a fresh download already; a restart takes seconds here)
    assert st0["active"] == v2 and (v1 in st0["dropped"] or st0["last_load"].get("version") == v1), st0
    assert v2 in st1["dropped"] or st1["last_load"].get("version") == v2, st1
    if st1["active"] is None:  # honest: not ready while it holds no active version
        assert st1["ready"] is False and readyz(pipe.servers[1].url) in (503, 200)
    for _ in range(50):  # whatever the moment, an answer is exact or a clear error
        answer = pipe.answer_or_clear_error(timeout=2)
        if answer == f"exact {v2}":
            break
    # The agents re-seed the published version and the pins: every answer exact again, files healed.
    wait_until(lambda: pipe.actives() == [v2, v2] and readyz(pipe.servers[1].url) == 200, 60, 0.3, "re-seed")
    wait_until(lambda: v1 in pipe.server_status(0).get("pinned", []), 60, 0.3, "the pin re-loaded")
    assert pipe.check_exact() == v2 and pipe.check_exact(v1) == v1
    # A load of a damaged file named directly: refused (422), the active version untouched.
    broken = pipe.data[0] / "broken"
    broken.mkdir()
    shutil.copy(pipe.data[0] / v2 / "shard-0.arrow", broken / "shard-0.arrow")
    _overwrite_middle(broken / "shard-0.arrow")
    r = requests.post(
        f"{pipe.servers[0].url}/v1/load",
        json={"version": "pass-20990101-00", "path": "broken/shard-0.arrow"},
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code in (409, 422) and pipe.server_status(0)["active"] == v2, r.text
    # A shard damaged on the file server after publishing: the agent's download fails its sha256 check,
    # the rollout fails on every shard, nothing changes.
    with pipe.agents[0].stopped(), pipe.agents[1].stopped():
        v3 = pipe.add_pass(3.0)
        published = pipe.fs_root / "cube" / v3 / "shard-0.arrow"
        wait_until(published.exists, 30, 0.1, "v3 published")
        wait_until(lambda: pipe.transfer_status()["in_flight"], 30, 0.1, "v3 in flight")
        _overwrite_middle(published)
    entry = wait_failed(pipe, v3)
    assert "sha256" in entry["reason"], entry
    assert pipe.actives() == [v2, v2] and pipe.check_exact() == v2
    assert not (pipe.data[0] / v3).exists()


@pytest.mark.needs_root
def test_a_full_disk_during_a_rollout_fails_it_cleanly_and_loses_nothing(tmp_path):
    """Shard 1's data folder and the file server's root on small tmpfs mounts: the first version fits,
    the second does not. The rollout fails with the reason, nothing half-written stays, every shard keeps
    serving the first version exactly; with room made, the same pass rolls out."""
    keys = np.unique(np.random.default_rng(7).integers(1, 2**64 - 1, 60_000, dtype=np.uint64))
    with contextlib.ExitStack() as stack:
        shard1 = stack.enter_context(tmpfs(tmp_path / "shard-1-disk", "1m"))
        p = Pipeline(tmp_path, keys, data_dirs=[tmp_path / "shard-0", shard1])
        stack.callback(p.close)
        p.start()
        v1 = p.roll_out(1.0)
        used = shutil.disk_usage(shard1).used
        assert used > 512 << 10, f"the version uses {used} bytes: too small to fill the disk"
        v2 = p.add_pass(2.0)
        entry = wait_failed(p, v2)
        # The agent says what happened (507, the device and its free space), not "internal error: OSError".
        assert "HTTP 507" in entry["reason"] and "no space left" in entry["reason"].lower(), entry
        assert "internal error" not in entry["reason"] and str(shard1) in entry["reason"], entry
        assert p.actives() == [v1, v1] and p.check_exact() == v1
        assert not (shard1 / v2).exists()
        assert shutil.disk_usage(shard1).used <= used + 64 * 1024, "a half-written copy stayed behind"
        # Room made: the retry goes through.
        import subprocess

        subprocess.run(["mount", "-o", "remount,size=8m", str(shard1)], check=True)
        p.wait_active(v2, 60)
        assert p.check_exact() == v2


@pytest.mark.slow
@pytest.mark.needs_root
def test_a_full_file_server_disk_fails_the_publish_and_keeps_current_json(tmp_path):
    keys = np.unique(np.random.default_rng(8).integers(1, 2**64 - 1, 60_000, dtype=np.uint64))
    with contextlib.ExitStack() as stack:
        stack.enter_context(tmpfs(tmp_path / "fileserver", "2m"))
        p = Pipeline(tmp_path, keys)
        stack.callback(p.close)
        p.start()
        v1 = p.roll_out(1.0)
        used = shutil.disk_usage(p.fs_root).used
        assert used > 1 << 20, used
        v2 = p.add_pass(2.0)
        entry = wait_failed(p, v2)
        assert "publish" in entry["reason"] and "507" in entry["reason"] and "space" in entry["reason"].lower(), entry
        assert p.actives() == [v1, v1] and p.check_exact() == v1
        current = json.loads((p.fs_root / "cube" / "current.json").read_text())
        assert current["version"] == v1
        leftovers = [f.name for f in p.fs_root.rglob("*") if f.is_file() and ".tmp" in f.name]
        assert not leftovers, leftovers
        import subprocess

        subprocess.run(["mount", "-o", "remount,size=16m", str(p.fs_root)], check=True)
        p.wait_active(v2, 60)
        assert p.check_exact() == v2


@pytest.mark.slow
def test_serving_over_a_stopped_or_killed_cube_shard_answers_clear_errors_and_heals(tmp_path, synth_world):
    """Serving (a real `elastic-control serve` following the file server) over the faulty pipeline: while a
    cube shard is stopped or killed, predictions are 503s with the reason (never a wrong probability) and
    /readyz says not ready; once the shard is back both are right again. Serving itself stopped or killed
    shows as hung or missing."""
    from helpers_common import PYTHON, free_port, process
    from helpers_faults import Component
    from helpers_serving import golden

    from ctr_foundation.records import DonefileEntry, append_donefile, utc_now

    pass_dir = synth_world.passes[0]
    lines, probs = golden(pass_dir)
    lines, probs = lines[:16], np.array(probs[:16])
    p = Pipeline(tmp_path, KEYS)
    with contextlib.ExitStack() as stack:
        stack.callback(p.close)
        p.start()
        name = "pass-20240101-00"
        shutil.copytree(pass_dir, p.models / name)
        meta = json.loads((p.models / name / "meta.json").read_text())
        (p.models / name / "meta.json").write_text(json.dumps({**meta, "pass": name, "kind": "base", "parent": None}))
        append_donefile(p.models, DonefileEntry(pass_name=name, path=name, window={}, time=utc_now()))
        requests.post(f"{p.transfer.url}/v1/poll", headers=AUTH, timeout=5)
        p.wait_active(name, 90)
        port = free_port()

        def start_serving(stack_, log_name):
            argv = [PYTHON, "-m", "elastic_control", "serve", "--host", "127.0.0.1", "--port", port, "--fileserver"]
            argv += [p.fileserver.url, "--cube-servers", ",".join(s.url for s in p.servers)]
            argv += ["--cache-dir", tmp_path / "serving-cache"]
            proc = stack_.enter_context(process(argv, {"OMP_NUM_THREADS": "1"}, tmp_path / f"{log_name}.log"))
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: proc.poll() is not None or readyz(url) == 200, 120, 0.2, "serving ready")
            assert proc.poll() is None, (tmp_path / f"{log_name}.log").read_text()[-2000:]
            return url, proc

        serving = Component("serving", start_serving).start()
        stack.callback(serving.stop)
        body = {"instances": [{"line": ln} for ln in lines]}

        def predict(timeout: float = 60) -> tuple[int, dict]:
            r = requests.post(f"{serving.url}/v1/predict", json=body, timeout=timeout)
            return r.status_code, r.json()

        def exact() -> bool:
            code, answer = predict()
            if code != 200:
                return False
            assert answer["model_version"] == name
            assert np.max(np.abs(np.array(answer["predictions"]) - probs)) < 1e-5, answer
            return True

        assert exact()
        server, took = p.servers[1], []
        for fault in ("SIGSTOP", "kill -9"):
            ctx = server.stopped() if fault == "SIGSTOP" else contextlib.nullcontext(server.kill9())
            with ctx:
                for _ in range(3):
                    t0 = time.monotonic()
                    code, answer = predict()
                    took.append(time.monotonic() - t0)
                    if code == 200:  # answered (from serving's embedding cache): then exactly
                        assert answer["model_version"] == name
                        assert np.max(np.abs(np.array(answer["predictions"]) - probs)) < 1e-5, (fault, answer)
                    else:
                        assert code == 503 and "cube" in json.dumps(answer).lower(), (fault, code, answer)
                # Readiness means "can answer": it turns 503 (serving probes its cube).
                wait_until(lambda: readyz(serving.url) == 503, 30, 0.5, f"serving's /readyz 503 after {fault}")
            if fault == "kill -9":
                server.start()
            wait_until(lambda: readyz(serving.url) == 200, 60, 0.3, f"serving ready again after {fault}")
            wait_until(exact, 30, 0.3, f"exact predictions after {fault}")
        assert max(took) < 60
        with serving.stopped():
            assert probe(serving, "serving") == st.HUNG
        serving.kill9()
        assert probe(serving, "serving") == st.MISSING
