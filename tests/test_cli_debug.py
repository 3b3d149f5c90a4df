"""ELASTIC_CTR_DEBUG is read through the typed registry: tracebacks only when it is on, one line otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(("value", "traceback"), [(None, False), ("1", True), ("on", True), ("0", False), ("x", False)])
def test_debug_variable_decides_tracebacks(tmp_path, value, traceback):
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_CTR_DEBUG"}
    if value is not None:
        env["ELASTIC_CTR_DEBUG"] = value
    res = subprocess.run(
        [sys.executable, "-m", "elastic_control", "status", "--state-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode != 0
    assert ("Traceback" in res.stderr) == traceback, res.stderr
    assert "run `elastic-control -r ...` first" in res.stderr
