"""Helpers for the file-server, client and serving tests: real servers in-process or as processes.

Passes come from the product trainer (the session fixtures in conftest.py);
generic helpers (free ports, processes, the file server in a thread) are in
helpers_common.py.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests
from helpers_common import PYTHON, REPO, fileserver_in_thread, free_port, process, wait_healthy
from helpers_cube import cube_processes, server_args
from helpers_passes import criteo_slot_lines

from ctr_foundation.records import GOLDEN_FILE, CurrentVersion, read_golden, utc_now, write_current

# PYTHON, REPO, free_port, process, wait_healthy, fileserver_in_thread and criteo_slot_lines are re-exported
# (their one definition is in helpers_common / helpers_passes).
__all__ = [
    "PYTHON",
    "REPO",
    "SERVING_TOKEN",
    "criteo_slot_lines",
    "cube_servers",
    "fileserver_in_thread",
    "free_port",
    "golden",
    "process",
    "predict_through_switch",
    "predicting_clients",
    "publish_version",
    "raw_request",
    "serving_in_thread",
    "set_current",
    "slots_instance",
    "status_of",
    "switch_cube_version",
    "wait_healthy",
]

SERVING_TOKEN = "t0ken"


def golden(pass_dir: Path) -> tuple[list[str], list[float]]:
    """(lines, probabilities) of a pass's golden.jsonl, read by records.py (the format's owner)."""
    return read_golden(Path(pass_dir) / GOLDEN_FILE)


def slots_instance(line: str) -> dict:
    """A slot-format line with at most one number per dense slot as the ``{"slots": ...}`` instance serving
    scores the same way: feasigns alternately as JSON integers and decimal strings, value tokens alternately
    as bare JSON numbers and one-element lists (an integer token of a dense slot stays a one-feasign list)."""
    from ctr_foundation.sample import parse_sample_line

    s = parse_sample_line(line)
    given: dict = {}
    for i, (f, slot) in enumerate(zip(s.feasigns, s.slots, strict=True)):
        given.setdefault(str(slot), []).append(str(f) if i % 2 else f)
    for i, (v, slot) in enumerate(zip(s.values, s.value_slots, strict=True)):
        if str(slot) in given:
            raise ValueError(f"{line!r}: slot {slot} has more than one number")
        given[str(slot)] = [v] if i % 2 else v
    return {"slots": given}


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes (paths exactly as written, no client-side normalisation); return the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            chunks.append(piece)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@contextlib.contextmanager
def serving_in_thread(source, wait_ready: bool = True, **kwargs):
    """A real serving HTTP server on 127.0.0.1:0 in this process.

    Ready (first version loaded) unless told not to wait.
    """
    from elastic_control.serving.app import ServingApp
    from elastic_control.serving.http_server import ServingServer

    grpc = kwargs.pop("grpc", False)
    server_kwargs = {k: kwargs.pop(k) for k in ("drain_delay", "drain_timeout", "max_body") if k in kwargs}
    app = ServingApp(source, poll_interval=kwargs.pop("poll_interval", 0.2), **kwargs)
    server = ServingServer(
        app, host="127.0.0.1", port=0, grpc_port=0 if grpc else None, **server_kwargs
    ).start_in_thread()
    try:
        deadline = time.monotonic() + 60
        while wait_ready and not app.readiness()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        yield server
    finally:
        server.stop()


def publish_version(fs_root: Path, pass_dir: Path, shards: int, *, make_current: bool = True) -> str:
    """What cube-transfer does, done directly: build shards, copy dense + meta, record current.json."""
    from cube.builder import build_version

    cube_root = fs_root / "cube"
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=cube_root)
    version = manifest["version"]
    shutil.copytree(pass_dir / "dense", cube_root / version / "dense")
    shutil.copy(pass_dir / "meta.json", cube_root / version / "meta.json")
    if make_current:
        set_current(fs_root, pass_dir, version, shards)
    return version


def set_current(fs_root: Path, pass_dir: Path, version: str, shards: int) -> None:
    """Record ``version`` as the active one in FS_ROOT/cube/current.json (the record records.py owns)."""
    from ctr_foundation.pass_format import load_pass

    info = load_pass(pass_dir)
    write_current(
        fs_root / "cube",
        CurrentVersion(
            version=version,
            pass_name=version,
            shards=shards,
            dim=info.embedding_dim,
            slots=tuple(info.slots),
            sparse_dim=info.sparse_dim,
            dense=f"cube/{version}/dense/",
            activated_at=utc_now(),
            donefile_time=utc_now(),
        ),
    )


@contextlib.contextmanager
def cube_servers(cube_root: Path, shards: int, log_dir: Path, token: str = SERVING_TOKEN):
    """``shards`` real cube-server processes serving ``cube_root``; yields their URLs (shard order)."""
    specs = [("server", server_args(cube_root, i), f"cube-{i}") for i in range(shards)]
    with cube_processes(specs, log_dir, env_extra={"ELASTIC_CTR_TOKEN": token}) as started:
        for url, proc in started:
            wait_healthy(url, proc)
        yield [url for url, _ in started]


def switch_cube_version(urls: list[str], version: str, token: str = SERVING_TOKEN) -> None:
    """Two-phase: load ``version`` on every shard, then activate it on every shard (cube-transfer's job)."""
    headers = {"Authorization": f"Bearer {token}"}
    for step in ("load", "activate"):
        for url in urls:
            r = requests.post(f"{url}/v1/{step}", json={"version": version}, headers=headers, timeout=60)
            assert r.status_code == 200, (step, url, r.text)


@contextlib.contextmanager
def predicting_clients(url: str, request: Callable[[int, int], tuple], clients: int = 4):
    """``clients`` threads post to ``url``/v1/predict until the block ends: client i's k-th request is
    ``request(i, k)`` = (tag, JSON body). Yields (answers: [(tag, response JSON)], errors: [response text])
    as they fill."""
    stop = threading.Event()
    answers, errors = [], []

    def client(i):
        s = requests.Session()
        k = 0
        while not stop.is_set():
            tag, body = request(i, k)
            r = s.post(url + "/v1/predict", json=body, timeout=60)
            if r.status_code != 200:
                errors.append(r.text)
            else:
                answers.append((tag, r.json()))
            k += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        yield answers, errors
    finally:
        stop.set()
        for t in threads:
            t.join()


def predict_through_switch(
    srv, lines: list[str], fs_root: Path, urls: list[str], new_pass: Path, *, start: Callable[[int, int], int]
) -> tuple[str, list[tuple[int, dict]], list[str]]:
    """4 clients post 8-line requests while ``new_pass`` is rolled out as cube-transfer does it (publish,
    prepare every shard, activate every shard, then record current.json) and serving follows it.

    Client ``i``'s ``k``-th request scores ``lines[start(i, k) : start(i, k) + 8]``. Returns the new
    version, every answer as (start, response JSON) and the bodies of failed requests."""

    def request(i, k):
        j = start(i, k)
        return j, {"instances": [{"line": ln} for ln in lines[j : j + 8]]}

    with predicting_clients(srv.url, request) as (answers, errors):
        time.sleep(1.0)
        version = publish_version(fs_root, new_pass, shards=len(urls), make_current=False)
        switch_cube_version(urls, version)
        set_current(fs_root, new_pass, version, len(urls))
        deadline = time.monotonic() + 30
        while srv.app.active.version != version and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # answers from the new version too
    return version, answers, errors


def copy_pass(src: Path, model_path: Path, name: str, *, donefile: bool = True) -> Path:
    """``src`` under a new pass name in ``model_path`` (same weights), recorded in its donefile."""
    import json as _json
    import shutil as _shutil

    from ctr_foundation.atomic import append_line_durably

    dst = model_path / name
    _shutil.copytree(src, dst)
    meta = _json.loads((dst / "meta.json").read_text())
    (dst / "meta.json").write_text(_json.dumps({**meta, "pass": name}))
    if donefile:
        append_line_durably(
            model_path / "donefile",
            _json.dumps({"pass": name, "path": str(dst), "window": meta.get("window", {}), "time": time.time()}),
        )
    return dst


_SHIFT_SCRIPT = r"""
import sys
import pyarrow  # before paddle
import numpy as np
import paddle

paddle.enable_static()
prefix, shift = sys.argv[1], float(sys.argv[2])
exe = paddle.static.Executor(paddle.CPUPlace())
program, feeds, fetches = paddle.static.load_inference_model(prefix, exe)
scope = paddle.static.global_scope()
shifted = 0
for var in program.list_vars():
    if var.persistable and var.name not in ("feed", "fetch") and tuple(var.shape) == (1,):
        tensor = scope.find_var(var.name).get_tensor()
        tensor.set(np.array(tensor) + np.float32(shift), paddle.CPUPlace())
        shifted += 1
assert shifted == 1, f"expected one bias of shape [1] (the output layer's), found {shifted}"
block = program.global_block()
paddle.static.save_inference_model(prefix, [block.var(n) for n in feeds], fetches, exe, program=program)
"""


def shift_output_logit(pass_dir: Path, shift: float) -> None:
    """Add ``shift`` to the dense model's output-layer bias: a deliberately miscalibrated model."""
    out = subprocess.run(
        [PYTHON, "-c", _SHIFT_SCRIPT, str(pass_dir / "dense" / "inference"), str(shift)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (pass_dir / "golden.jsonl").unlink(missing_ok=True)  # its probabilities are not the shifted model's


@dataclass(frozen=True)
class ServedPasses:
    """MODEL_PATH with three passes: A (trained), M = A with its output logit shifted by +1.5 (a
    miscalibrated challenger), and C = A under the newest name (the control: what ModelDirSource serves)."""

    models: Path
    a: Path
    miscalibrated: Path
    control: Path


def make_served_passes(root: Path, world) -> ServedPasses:
    """The three passes from the session's Criteo pass (the ``criteo_world`` fixture: `elastic-control train`)."""
    a = copy_pass(world.latest, root, "pass-20200101-00")
    m = copy_pass(a, root, "pass-20200101-01")
    shift_output_logit(m, 1.5)
    c = copy_pass(a, root, "pass-20200101-02")
    return ServedPasses(root, a, m, c)


def _served_fixture(tmp_path_factory, criteo_world):
    return make_served_passes(tmp_path_factory.mktemp("served-models"), criteo_world)


def _install_fixture():
    import pytest

    return pytest.fixture(scope="session", name="served")(_served_fixture)


# Import this into a test module (``from helpers_serving import served_fixture``) for the session-scoped
# fixture ``served``: one training run shared by every serving test module of the session.
served_fixture = _install_fixture()


def scale_embeddings(pass_dir: Path, factor: float) -> None:
    """Multiply every embedding in the pass's sparse table by ``factor`` and rewrite golden.jsonl with the
    probabilities offline scoring gives the changed pass (a version whose rows differ from its source's)."""
    import gzip
    import json as _json

    import pyarrow  # noqa: F401  (before paddle)

    from ctr_foundation.pass_format import load_pass, sparse_part_files
    from elastic_control.inference.scoring import DenseModel, InMemoryTable, score_lines

    info = load_pass(pass_dir)
    cols = info.layout.embedding_column_indices()
    for part in sparse_part_files(pass_dir):
        opener = gzip.open if part.name.endswith(".gz") else open
        with opener(part, "rt", encoding="ascii") as f:
            rows = [ln.split() for ln in f if ln.strip()]
        for toks in rows:
            for i in cols:
                toks[i] = f"{float(toks[i]) * factor:.8g}"
        with opener(part, "wt", encoding="ascii") as f:
            f.write("".join(" ".join(t) + "\n" for t in rows))
    lines = [_json.loads(ln)["line"] for ln in (pass_dir / "golden.jsonl").read_text().splitlines() if ln.strip()]
    probs = score_lines(lines, info, InMemoryTable.from_pass(info).lookup, DenseModel.from_pass(info))
    (pass_dir / "golden.jsonl").write_text(
        "".join(_json.dumps({"line": ln, "prob": float(p)}) + "\n" for ln, p in zip(lines, probs, strict=True))
    )
