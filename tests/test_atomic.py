import os

import pytest

from ctr_foundation.atomic import append_line_durably, atomic_open, atomic_write_text, staged_directory


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert [x.name for x in tmp_path.iterdir()] == ["f.txt"]


def test_failed_write_leaves_previous_file_and_no_temp(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_open(p) as f:
            f.write("half")
            raise RuntimeError("crash mid-write")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.txt"]


def test_append_line_rejects_newlines_and_appends(tmp_path):
    p = tmp_path / "donefile"
    append_line_durably(p, '{"a": 1}')
    append_line_durably(p, '{"a": 2}')
    assert p.read_text().splitlines() == ['{"a": 1}', '{"a": 2}']
    with pytest.raises(ValueError):
        append_line_durably(p, "two\nlines")


def test_staged_directory_is_all_or_nothing(tmp_path):
    final = tmp_path / "pass-1"
    with staged_directory(final) as d:
        (d / "a").write_text("1")
    assert (final / "a").read_text() == "1"
    with pytest.raises(OSError):
        with staged_directory(final) as d:
            (d / "b").write_text("2")
            raise OSError("disk full")
    assert sorted(os.listdir(final)) == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["pass-1"]
