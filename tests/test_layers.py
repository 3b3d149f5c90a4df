"""The layering of docs/contracts.md, checked on every import statement (module level and lazy)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> project packages it may import (besides itself)
ALLOWED = {
    "ctr_foundation": set(),
    "cube": {"ctr_foundation"},
    "client": {"ctr_foundation", "elastic_control.config"},
    "elastic_control": {"ctr_foundation", "cube", "client"},
}
PROJECT = {"ctr_foundation", "cube", "client", "elastic_control", "tests", "bench"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _violations(package: str) -> list[str]:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in PROJECT or top == package:
                continue
            if not any(module == a or module.startswith(a + ".") for a in allowed):
                # `from elastic_control import config` is the same as importing elastic_control.config
                if not any(a.startswith(module + ".") and module != top for a in allowed):
                    bad.append(f"{path.relative_to(REPO)}:{line}: imports {module}")
    return sorted(set(bad))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_only_point_down(package):
    assert _violations(package) == []


def test_cube_transfer_loads_no_paddle_mlflow_or_evaluation():
    code = (
        "import sys, cube.transfer, cube.server, cube.agent, cube.builder\n"
        "heavy = ('paddle', 'mlflow', 'elastic_control', 'sklearn')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(','.join(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_bench_imports_no_test_helpers_and_puts_no_tests_on_the_path():
    helpers = {p.stem for p in (REPO / "tests").glob("*.py")} | {"tests"}
    offenders = []
    for path in sorted((REPO / "bench").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bad = sorted({m for _, m in imported_modules(path) if m.split(".")[0] in helpers})
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "tests"]
        if bad or strings:
            offenders.append(f"{path.relative_to(REPO)}: {bad or 'tests on sys.path'}")
    assert offenders == []


def _functions(*folders: str):
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef):
                    yield f"{path.relative_to(REPO)}:{node.name}", node.name


def test_one_auc_implementation():
    """Training, evaluation, the demo, the synthetic generator and the benchmarks all use elastic_control.metrics."""
    defined = [where for where, name in _functions("bench", *ALLOWED) if name.lower().startswith(("auc", "roc"))]
    assert "elastic_control/metrics.py:auc" in defined
    outside = [d for d in defined if not d.startswith(("elastic_control/metrics.py:", "elastic_control/evaluation/"))]
    assert outside == [], "AUC is computed in elastic_control/metrics.py only"
    synth = {m for _, m in imported_modules(REPO / "elastic_control" / "data" / "synth.py")}
    assert not any(m.startswith("elastic_control.training") for m in synth)


def test_one_free_port_helper_in_the_tests():
    """Tests take ports from helpers_common.free_port (below the ephemeral range, like the product)."""
    defined = [w for w, name in _functions("tests") if "free_port" in name and not name.startswith("test_")]
    assert defined == ["tests/helpers_common.py:free_port"]
