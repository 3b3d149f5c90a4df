"""Trainer 0's per-pass output: dense/, sparse/, golden.jsonl, meta.json, then the donefile line.

Everything is written into a hidden staging folder beside the pass
(``atomic.staged_directory``), renamed into place when complete, and only then
is the donefile line appended. A crash at any point leaves either a hidden
``.pass-*.tmp`` folder (removed on restart) or a pass folder without a
donefile line: neither counts as a pass, and the job resumes after the last
one that does.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ctr_foundation import pass_format
from ctr_foundation.atomic import atomic_write_json, staged_directory
from ctr_foundation.env_vars import TEST_CRASH_EXPORT
from ctr_foundation.records import GOLDEN_FILE, DonefileEntry, append_donefile, utc_now, write_golden
from elastic_control.config.data_config import format_slot
from elastic_control.training.model import SPARSE_ACCESSOR


def _maybe_crash(stage: str, name: str) -> None:
    """Test hook ELASTIC_CTR_TEST_CRASH_EXPORT=<stage>[:<pass name>]: exit at that stage, as a machine failure would."""
    want = TEST_CRASH_EXPORT.get() or ""
    if want in (stage, f"{stage}:{name}"):
        print(f"[test] crashing during the export of {name} at stage {stage!r}", flush=True)
        os._exit(3)


def write_pass(
    model_path: str | os.PathLike,
    *,
    hour_start: dt.datetime,
    hour_end: dt.datetime,
    save_sparse: Callable[[Path], None],
    save_dense: Callable[[Path], None],
    score_golden: Callable[[], list[dict]],
    meta: dict,
    minutes: int | None = None,
) -> DonefileEntry:
    """Stage and publish one pass; return the donefile entry.

    ``score_golden`` runs AFTER the sparse and dense exports so the golden
    probabilities come from exactly the exported state. ``save_sparse`` may add
    to ``meta`` (the incremental export's key counts). With ``minutes``
    (PASS_MINUTES) the pass is named ``pass-YYYYMMDD-HHMM`` and its window says
    ``YYYYMMDD/HHMM``. meta's ``kind``/``parent`` (delta passes) go on the
    donefile line too.
    """
    name = pass_format.pass_name(hour_end, minutes=bool(minutes))
    final = Path(model_path) / name
    window = {"start": format_slot(hour_start, minutes), "end": format_slot(hour_end, minutes)}
    with staged_directory(final) as stage:
        save_sparse(stage / pass_format.SPARSE_DIR)
        _maybe_crash("after_sparse", name)
        save_dense(stage / pass_format.DENSE_DIR / pass_format.DENSE_PREFIX)
        golden = score_golden()
        write_golden(stage / GOLDEN_FILE, [r["line"] for r in golden], [r["prob"] for r in golden])
        full_meta = dict(
            meta,
            **{
                "pass": name,
                "window": window,
                "dense_input": pass_format.DENSE_INPUT,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        atomic_write_json(stage / pass_format.META_FILE, full_meta)
        _maybe_crash("before_rename", name)
    _maybe_crash("before_donefile", name)
    lineage = {k: meta[k] for k in ("kind", "parent") if k in meta}
    entry = DonefileEntry(name, str(final.resolve()), window, utc_now(), dict(meta.get("metrics", {})), lineage)
    append_donefile(model_path, entry)
    return entry


def clear_op_callstacks(model_file: str | os.PathLike) -> int:
    """Rewrite a saved inference program without its ops' ``op_callstack`` attributes; returns how many went.

    Paddle records the Python stack that created each op (the feed and fetch ops ``save_inference_model``
    adds keep theirs), file names included: a published model would show the training host's paths. The
    attribute is a debugging aid only; the program computes the same without it. The edit is on the
    protobuf itself, so nothing else of the program changes.
    """
    from paddle.base.proto import framework_pb2

    path = Path(model_file)
    program = framework_pb2.ProgramDesc()
    program.ParseFromString(path.read_bytes())
    removed = 0
    for block in program.blocks:
        for op in block.ops:
            kept = [a for a in op.attrs if a.name != "op_callstack"]
            if len(kept) != len(op.attrs):
                removed += len(op.attrs) - len(kept)
                del op.attrs[:]
                op.attrs.extend(kept)
    if removed:
        path.write_bytes(program.SerializeToString())  # inside the pass's staging folder: no reader yet
    return removed


def golden_rows(lines: list[str], probs: np.ndarray) -> list[dict]:
    return [{"line": ln, "prob": float(p)} for ln, p in zip(lines, np.asarray(probs).ravel().tolist(), strict=True)]


def sparse_layout_json(embedding_dim: int, *, optimizer: str = "adam", embed_optimizer: str | None = None) -> dict:
    """meta.json ``sparse_layout``: the saved table's columns (rules of embedx_w and embed_w, model.SPARSE_RULES)."""
    layout = pass_format.SparseLayout(embedding_dim, optimizer, embed_optimizer).to_json()
    layout["accessor"] = SPARSE_ACCESSOR
    return layout
