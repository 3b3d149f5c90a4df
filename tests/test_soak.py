"""The soak (bench/soak.py) in short: 32 checking clients, hot reloads, 1,000 idle connections, zero failures.

The full run is `python bench/soak.py --minutes 10` (figures in docs/benchmarks.md); this one runs it for
a minute and a half on the session's product-trained passes.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers_common import PYTHON, REPO


@pytest.mark.slow
def test_a_short_soak_has_zero_failed_requests_and_stable_memory(tmp_path, synth_world):
    a, b = synth_world.passes[:2]
    out = tmp_path / "soak.json"
    argv = [PYTHON, REPO / "bench" / "soak.py", "--minutes", "1.5", "--reload-every", "20", "--baseline", "5"]
    argv += ["--passes", f"{a},{b}", "--workdir", tmp_path / "work", "--json", out]
    r = subprocess.run([str(x) for x in argv], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["failed"] == 0 and figures["requests"] > 1000 and figures["reloads"] >= 3, figures
    assert figures["idle_min"] >= 900 and all(figures["stable"].values()), figures
