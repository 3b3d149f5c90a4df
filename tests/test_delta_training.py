"""Delta passes written by the real trainer: 2 pservers + 2 trainers, three hourly passes with
DELTA_PASSES=1, admission and eviction on, a crash during the third pass's export and a resume; then the
passes go through real cube processes (file server, cube-transfer, two shards)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json

import numpy as np
import pytest
from helpers_cube import TOKEN, agent_args, cube_process, fileserver, free_port, server_args
from helpers_train import START, read_golden, run_training, score_pass, write_job

from ctr_foundation import pass_format
from ctr_foundation.errors import ComponentError
from ctr_foundation.records import read_donefile
from ctr_foundation.sparse_table_reader import iter_deleted_keys

SLOTS = (1, 2, 3, 4)
PASSES = ["pass-20191221-00", "pass-20191221-01", "pass-20191221-02"]
# A long first hour and short later ones over a large Zipf vocabulary: each later hour touches a small part
# of the table (the head of the vocabulary, and a few new tail keys), as hourly increments of a big table do.
LINES = (20000, 300, 300)
EXTRA = 'export DELTA_PASSES="1"\nexport ADMIT_MIN_COUNT="2"\nexport EVICT_AFTER_PASSES="2"\n'


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from elastic_control.data.hourly_writer import write_hour
    from elastic_control.data.synth import build_planted_model, sample_lines

    root = tmp_path_factory.mktemp("delta-training")
    job = write_job(root, slots=SLOTS, hours=len(LINES), extra=EXTRA)
    model = build_planted_model(SLOTS, 5, vocab=20000)
    for h, n in enumerate(LINES):
        lines, _, _ = sample_lines(model, n, np.random.default_rng([5, h]))
        write_hour(job.data, START + dt.timedelta(hours=h), lines)
    full = root / "pserver-tables"  # the whole pserver table after every export (test hook)
    env = {"ELASTIC_CTR_TEST_FULL_SAVE": str(full)}
    crash = dict(env, ELASTIC_CTR_TEST_CRASH_EXPORT=f"before_donefile:{PASSES[2]}")
    with pytest.raises(ComponentError, match="trainer-0 failed"):
        run_training(job, trainers=2, pservers=2, timeout=500, env=crash)
    assert [p.name for p in pass_format.complete_passes(job.models)] == PASSES[:2]
    result = run_training(job, trainers=2, pservers=2, timeout=500, env=env)
    assert result.passes == PASSES
    return job, full


def _meta(job, name) -> dict:
    return json.loads((job.models / name / "meta.json").read_text())


def _chain_view(job, name):
    """{key: (embedding or None, kind)} for the pass from its files alone, the served rows read with the
    Python reference parser: walk the chain from the base, each pass's deletes then its rows; kind 'sparse'
    (cube serves it) or 'pending' (not admitted yet: only its key matters)."""
    from elastic_control.training.key_state import PENDING_DIR
    from elastic_control.training.table_files import read_part_keys, table_parts

    view: dict[int, tuple[np.ndarray | None, str]] = {}
    for info in pass_format.pass_chain(job.models / name):
        for keys in [*iter_deleted_keys(info.path), *iter_deleted_keys(info.path / PENDING_DIR)]:
            for k in keys.tolist():
                view.pop(k, None)
        for keys, values in pass_format.iter_sparse_table(info.path, info.layout):
            for k, v in zip(keys.tolist(), values, strict=True):
                view[k] = (v, "sparse")
        for part in table_parts(info.path / PENDING_DIR).values():
            for k in read_part_keys(part).tolist():
                view[k] = (None, "pending")
    return view


def _full_table(folder) -> dict[int, str]:
    """A pserver save (test hook): {key: line with delta_score zeroed} (mode-0 saves keep delta_score)."""
    from elastic_control.training.table_files import PartLines, read_part_lines, table_parts, zero_delta_score

    lines = PartLines.concat([read_part_lines(p) for p in table_parts(folder).values()])
    return dict(zip(lines.keys.tolist(), zero_delta_score(lines.lines).to_pylist(), strict=True))


def _chain_lines(job, name) -> dict[int, str]:
    from elastic_control.training.delta_export import assemble_resume_table

    out = assemble_resume_table(job.models / name, job.root / "assembled" / name, shards=16, mine=range(16))
    return _full_table(out)


@pytest.mark.e2e
def test_passes_two_and_three_are_deltas_with_far_fewer_rows_and_the_chain_is_the_whole_table(trained):
    job, full = trained
    metas = [_meta(job, n) for n in PASSES]
    assert [(m["kind"], m["parent"]) for m in metas] == [("base", None), ("delta", PASSES[0]), ("delta", PASSES[1])]
    entries = read_donefile(job.models)
    assert [(e.pass_name, e.kind, e.parent) for e in entries] == [
        (n, m["kind"], m["parent"]) for n, m in zip(PASSES, metas, strict=True)
    ]
    base_rows = metas[0]["metrics"]["rows"]
    for m in metas[1:]:
        rows = sum(1 for _ in _lines(job.models / m["pass"] / "sparse"))
        assert rows == m["metrics"]["rows"] and rows < base_rows / 4, (rows, base_rows)
    # EVICT_AFTER_PASSES=2: the base's keys not pushed in passes 2 and 3 are evicted at the end of pass 3
    # and are deletes of its delta (the admitted ones in deleted/, the pending ones in pending/deleted/).
    assert metas[1]["metrics"]["keys_evicted"] == 0 and metas[2]["metrics"]["keys_deleted"] > 0
    deleted = np.concatenate(list(iter_deleted_keys(job.models / PASSES[2])))
    assert len(deleted) == metas[2]["metrics"]["keys_deleted"]
    # Every pass's chain (base + deltas, admitted + pending keys, deletes applied) is exactly what the
    # pservers held right after its export: no changed key is missing from a delta, no deleted key lingers.
    for name in PASSES:
        want, got = _full_table(full / name), _chain_lines(job, name)
        assert got.keys() == want.keys() and got == want, name
    # Admission: keys seen once are pending (not in sparse/, so cube never serves them) and counted.
    m = metas[2]["metrics"]
    assert m["keys_pending"] > 0 and m["keys_admitted"] > 0 and m["keys_live"] == m["keys_pending"] + m["keys_admitted"]
    # The counts per pass are in MLflow too (trainer 0's run of the resumed job).
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{job.models.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("elastic-ctr").experiment_id])
    newest = max(runs, key=lambda r: r.info.start_time)  # the resumed job's run wrote pass 3
    logged = newest.data.metrics
    assert logged["pass_keys_live"] == m["keys_live"] and logged["pass_keys_evicted"] == m["keys_evicted"]
    assert {"pass_keys_admitted", "pass_keys_pending", "pass_keys_newly_admitted", "pass_rows"} <= set(logged)
    # golden.jsonl (scored by the training program, admission masks included) reproduces from each pass's
    # whole table: what evaluation and serving compute.
    for name in PASSES:
        lines, golden = read_golden(job.models / name)
        np.testing.assert_allclose(score_pass(job.models / name, lines), golden, atol=1e-5, rtol=0)


def _lines(folder):
    from elastic_control.training.table_files import read_part_lines, table_parts

    for p in table_parts(folder).values():
        yield from read_part_lines(p).keys.tolist()


@pytest.mark.e2e
def test_resume_after_a_crash_reloads_base_and_deltas_on_every_pserver(trained):
    job, full = trained
    for i in range(2):
        log = (job.models / "logs" / f"train-pserver-{i}.log").read_text()
        assert f"resuming: loading the whole table of {PASSES[1]}" in log, log[-2000:]
    log = (job.models / "logs" / "train-trainer-0.log").read_text()
    assert f"resuming after {PASSES[1]}" in log and f"key state after {PASSES[1]}" in log
    # The pass written after the resume is a delta on the last complete pass, and its chain is the table.
    assert _meta(job, PASSES[2])["parent"] == PASSES[1]
    assert _chain_lines(job, PASSES[2]) == _full_table(full / PASSES[2])
    assert not list(job.models.glob(".resume-*"))  # the assembled tables are removed after loading
    # The resumed pservers start with every delta_score at 0: pass 3's delta holds only keys of hour 3's
    # lines (a reloaded key that was not pushed again would otherwise show up as changed).
    from ctr_foundation.sample import PADDING_FEASIGN
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.training.key_state import PENDING_DIR

    hour = hour_dir(job.data, START + dt.timedelta(hours=2))
    seen = {PADDING_FEASIGN}
    for part in hour.glob("part-*"):
        for line in part.read_text().splitlines():
            seen.update(int(tok.split(":")[0]) for tok in line.split()[2:])
    delta = set(_lines(job.models / PASSES[2] / "sparse")) | set(_lines(job.models / PASSES[2] / PENDING_DIR))
    assert delta and delta <= seen, len(delta - seen)


class Shards:
    """A file server, cube-transfer (in this process) and two real cube shards (server + agent each)."""

    def __init__(self, root, models, stack: contextlib.ExitStack):
        self.root, self.models, self.stack = root, models, stack
        self.fs_url = stack.enter_context(fileserver(root / "fileserver"))
        self.ports = [free_port() for _ in range(2)]
        self.servers = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.agents = ["", ""]
        self.pods = [None, None]
        for i in range(2):
            self.start(i)

    def start(self, i, tag=""):
        data = self.root / f"shard-{i}"
        data.mkdir(exist_ok=True)
        pod = contextlib.ExitStack()
        pod.enter_context(
            cube_process("server", server_args(data, i, port=self.ports[i]), self.root, f"server-{i}{tag}")
        )
        self.agents[i] = pod.enter_context(
            cube_process("agent", agent_args(data, i, self.servers[i], self.fs_url), self.root, f"agent-{i}{tag}")
        )[0]
        self.pods[i] = pod
        self.stack.callback(pod.close)

    def transfer(self, gate=None):
        from cube.rollout import RetryPolicy
        from cube.transfer import Transfer, TransferConfig

        return Transfer(
            TransferConfig(
                model_path=self.models,
                cube_root=self.root / "built",
                fileserver_url=self.fs_url,
                agents=self.agents,
                token=TOKEN,
                retry=RetryPolicy(attempts=2, backoff=0.1, timeout=60),
                compact_after=0,
                gate=gate,
            )
        )


def _answers(servers, keys):
    from cube.client import CubeClient

    with CubeClient(servers) as c:
        return c.lookup(np.asarray(keys, dtype=np.uint64))


@pytest.mark.e2e
@pytest.mark.slow  # the default suite: test_cube_delta's catch-up of a restarted shard on base and deltas
def test_cube_serves_pass_three_as_its_latest_delta_or_base_and_a_restarted_shard_catches_up(
    trained, tmp_path, monkeypatch
):
    import shutil
    import time

    import requests

    from cube.promotion_gate import CommandGate

    job, _ = trained
    monkeypatch.setenv("ELASTIC_CTR_DATA_CONFIG", str(job.data_config))  # the gate's hold-out data
    # cube-transfer sees the passes one at a time, as they were published.
    models = tmp_path / "models"
    models.mkdir()
    entries = read_donefile(job.models)
    view = _chain_view(job, PASSES[2])
    served = {k: v for k, (v, kind) in view.items() if kind == "sparse"}
    pending = [k for k, (_, kind) in view.items() if kind == "pending"]
    ever = set()
    for name in PASSES:
        ever |= set(_chain_view(job, name))
    deleted = sorted(ever - set(view))
    assert served and pending and deleted
    with contextlib.ExitStack() as stack:
        shards = Shards(tmp_path, models, stack)
        # With the promotion gate on: it scores each delta with its whole table (a delta's own rows alone
        # would answer zeros for most keys) against the active pass.
        t = shards.transfer(gate=CommandGate("auc_drop<=0.05,min_examples>=50"))
        for n, name in enumerate(PASSES):
            shutil.copytree(job.models / name, models / name)
            (models / "donefile").write_text("".join(json.dumps(e.to_json()) + "\n" for e in entries[: n + 1]))
            assert t.poll_once() == name, (t.last_error, t.status()[1]["passes"].get(name))
        timings = t.status()[1]["active"]["timings"]
        assert timings["shipped"] == {"0": [PASSES[2]], "1": [PASSES[2]]}  # only the delta
        manifest = json.loads((tmp_path / "built" / PASSES[2] / "manifest.json").read_text())
        assert (manifest["kind"], manifest["parent"], manifest["depth"]) == ("delta", PASSES[1], 2)

        def check():
            keys = np.array(sorted(served), dtype=np.uint64)
            got, found, version = _answers(shards.servers, keys)
            assert version == PASSES[2] and found.all()
            np.testing.assert_array_equal(got, np.array([served[k] for k in keys.tolist()], dtype=np.float32))
            for absent in (deleted, pending):  # evicted keys, and keys not admitted yet: not found, zeros
                got, found, _ = _answers(shards.servers, absent)
                assert not found.any() and not got.any()

        check()
        # Shard 1's pod is replaced with an empty folder: its agent catches up on base + both deltas.
        shards.pods[1].close()
        shutil.rmtree(tmp_path / "shard-1")
        shards.start(1, tag="-new")
        deadline = time.monotonic() + 90
        while True:  # the agent records its re-seed right after activating it
            try:
                seeded = requests.get(f"{shards.agents[1]}/v1/status", timeout=5).json()["last"]
                if seeded.get("seeded") == PASSES[2]:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "shard 1 did not come back on the active version"
            time.sleep(0.3)
        assert requests.get(f"{shards.servers[1]}/v1/status", timeout=5).json()["active"] == PASSES[2]
        assert seeded["downloaded"] == PASSES
        check()


def _reference_scores(job, name, lines):
    """Scores of ``lines`` under pass ``name`` with its table assembled by the test itself (_chain_view)."""
    from elastic_control.inference import scoring

    info = pass_format.load_pass(job.models / name)
    view = {k: v for k, (v, kind) in _chain_view(job, name).items() if kind == "sparse"}
    keys = np.array(sorted(view), dtype=np.uint64)
    table = scoring.InMemoryTable(keys, np.array([view[k] for k in keys.tolist()], dtype=np.float32))
    return scoring.score_lines(lines, info, table.lookup, scoring.DenseModel.from_pass(info))


@pytest.mark.e2e
def test_eval_and_the_promotion_gate_score_a_delta_with_its_whole_table(trained, tmp_path):
    import subprocess
    import sys

    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.evaluation.gate import evaluate_candidate
    from elastic_control.metrics import auc_from_counts, counts_from_arrays

    job, _ = trained
    hour = hour_dir(job.data, START + dt.timedelta(hours=2))
    lines = [ln for p in sorted(hour.glob("part-*")) for ln in p.read_text().splitlines() if ln.strip()]
    labels = np.array([int(ln.split()[1]) for ln in lines])
    want, _ = auc_from_counts(counts_from_arrays(labels, _reference_scores(job, PASSES[2], lines)))
    out = tmp_path / "eval"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_control",
            "eval",
            "--model",
            str(job.models / PASSES[2]),
            "-f",
            str(job.data_config),
            "--start",
            "20191221/02",
            "--end",
            "20191221/02",
            "--workers",
            "1",
            "--output",
            str(out),
            "--no-mlflow",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())["model"]
    assert metrics["examples"] == len(lines) and metrics["auc"] == pytest.approx(want, abs=1e-9)
    decision = evaluate_candidate(
        job.models / PASSES[2],
        job.models / PASSES[1],
        "auc_drop<=1,min_examples>=1",
        data_config=job.data_config,
        workers=1,
        record=False,
    )
    assert decision.passed, decision.reason
    assert decision.metrics["model"]["auc"] == pytest.approx(want, abs=1e-9)
