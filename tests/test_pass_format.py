import gzip
import json

import numpy as np
import pytest

from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import (
    SparseLayout,
    complete_passes,
    iter_sparse_table,
    load_pass,
    read_sparse_table,
)
from ctr_foundation.records import read_donefile


def _write_table(pass_dir, rows, layout):
    table = pass_dir / "sparse" / "000"
    table.mkdir(parents=True)
    e, x = layout.state_columns
    with gzip.open(table / "part-000-00001.gz", "wt") as f:
        for key, emb in rows:
            cols = [str(key), "0", "0", "1.5", "3", "1", repr(float(emb[0]))]
            cols += ["0.1"] * e + [repr(float(v)) for v in emb[1:]] + ["0.2"] * x
            f.write(" ".join(cols) + "\n")


def test_adam_layout_matches_paddle_2_6_column_count():
    # Seen in a real fleet.save_persistables of an 8-dim sparse_embedding with Adam: 34 columns.
    assert 1 + SparseLayout(8, "adam").value_columns == 34
    assert list(SparseLayout(8, "adam").embedding_column_indices()) == [6, 11, 12, 13, 14, 15, 16, 17]


def test_sparse_table_roundtrip_with_uint64_keys(tmp_path):
    layout = SparseLayout(3, "adam")
    big = (1 << 64) - 5
    rows = [(big, [0.5, -1.0, 2.0]), (7, [1.0, 2.0, 3.0]), (-3, [4.0, 5.0, 6.0])]  # -3 is 2**64-3 printed signed
    _write_table(tmp_path, rows, layout)
    keys, values = read_sparse_table(tmp_path, layout)
    assert keys.dtype == np.uint64
    assert keys.tolist() == [7, (1 << 64) - 5, (1 << 64) - 3]
    np.testing.assert_array_equal(values[0], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(values[1], [0.5, -1.0, 2.0])


def test_wrong_column_count_names_file_and_line(tmp_path):
    _write_table(tmp_path, [(1, [1.0, 2.0, 3.0])], SparseLayout(3, "adagrad"))
    with pytest.raises(DataError, match=r"part-000-00001.gz:1: .*expected"):
        list(iter_sparse_table(tmp_path, SparseLayout(3, "adam")))


def test_donefile_ignores_torn_last_line_and_missing_folders(tmp_path):
    (tmp_path / "pass-20191221-00").mkdir()
    (tmp_path / "pass-20191221-00" / "meta.json").write_text(json.dumps({"slots": [1], "embedding_dim": 9}))
    (tmp_path / "donefile").write_text('{"pass": "pass-20191221-00"}\n{"pass": "pass-20191221-01"}\n{"pass": "pa')
    assert [e.pass_name for e in read_donefile(tmp_path)] == ["pass-20191221-00", "pass-20191221-01"]
    assert [p.name for p in complete_passes(tmp_path)] == ["pass-20191221-00"]


_RESAVE_SCRIPT = r"""
import sys
import pyarrow  # before paddle
import paddle

paddle.enable_static()
exe = paddle.static.Executor(paddle.CPUPlace())
program, feeds, fetches = paddle.static.load_inference_model(sys.argv[1], exe)
block = program.global_block()
paddle.static.save_inference_model(sys.argv[2], [block.var(n) for n in feeds], fetches, exe, program=program)
"""


def test_clearing_op_callstacks_keeps_the_program_scoring_bit_for_bit(synth_world, tmp_path):
    import subprocess

    import pyarrow  # noqa: F401  (before paddle)

    from helpers_common import PYTHON

    from elastic_control.inference.scoring import DenseModel
    from elastic_control.training.pass_export import clear_op_callstacks

    # save_inference_model as the trainer calls it: its feed and fetch ops record the calling stack
    src = synth_world.latest / "dense" / "inference"
    raw, cleared = tmp_path / "raw" / "inference", tmp_path / "cleared" / "inference"
    for prefix in (raw, cleared):
        out = subprocess.run([PYTHON, "-c", _RESAVE_SCRIPT, str(src), str(prefix)], capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    assert b"op_callstack" in raw.with_suffix(".pdmodel").read_bytes()
    assert clear_op_callstacks(cleared.with_suffix(".pdmodel")) > 0
    text = cleared.with_suffix(".pdmodel").read_bytes()
    assert b"op_callstack" not in text and b".py" not in text
    assert clear_op_callstacks(cleared.with_suffix(".pdmodel")) == 0  # idempotent
    info = load_pass(synth_world.latest)
    width = len(info.slots) * info.embedding_dim + len(info.dense_slots)
    x = np.random.default_rng(0).normal(0, 0.5, (257, width)).astype(np.float32)
    a, b = DenseModel(raw, onednn=False).predict(x), DenseModel(cleared, onednn=False).predict(x)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_trained_pass_carries_no_host_path_and_still_scores_its_golden_lines(synth_world):
    from helpers_common import REPO
    from helpers_train import read_golden, score_pass

    for pass_dir in synth_world.passes:
        model = (pass_dir / "dense" / "inference.pdmodel").read_bytes()
        assert b"op_callstack" not in model
        for host_path in (str(REPO), str(synth_world.root)):
            assert host_path.encode() not in model, f"{pass_dir.name}: inference.pdmodel names {host_path}"
        lines, probs = read_golden(pass_dir)
        assert lines
        np.testing.assert_allclose(score_pass(pass_dir, lines), probs, rtol=0, atol=1e-5)
