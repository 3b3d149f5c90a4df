"""Import rules that keep the layers apart, read from the source (no import needed)."""

from __future__ import annotations

import ast

import pytest
from helpers_common import REPO

PRODUCT = ("ctr_foundation", "elastic_control", "cube", "client")
TEST_HELPERS = {p.stem for p in (REPO / "tests").glob("*.py")}


def _sources(*folders: str):
    for folder in folders:
        yield from sorted((REPO / folder).rglob("*.py"))


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _strings(path) -> list[str]:
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


@pytest.mark.parametrize("folder", ["bench", *PRODUCT])
def test_nothing_outside_tests_imports_test_helpers_or_puts_tests_on_the_path(folder):
    offenders = []
    for path in _sources(folder):
        bad = {m for m in _imports(path) if m.split(".")[0] in TEST_HELPERS or m.split(".")[0] == "tests"}
        if bad or any(s == "tests" for s in _strings(path)):
            offenders.append(f"{path.relative_to(REPO)}: {sorted(bad) or 'tests on sys.path'}")
    assert offenders == []


def test_the_product_imports_no_benchmark_code():
    bench = {p.stem for p in (REPO / "bench").glob("*.py")}
    offenders = [
        f"{path.relative_to(REPO)}: {m}"
        for path in _sources(*PRODUCT)
        for m in _imports(path)
        if m.split(".")[0] in bench | {"bench"}
    ]
    assert offenders == []


def test_one_auc_implementation():
    """Training, evaluation, the demo, the synthetic generator and the benchmarks all use elastic_control.metrics."""
    defined = [
        f"{path.relative_to(REPO)}:{node.name}"
        for path in _sources("bench", *PRODUCT)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.lower().startswith(("auc", "roc"))
    ]
    outside = [d for d in defined if not d.startswith(("elastic_control/metrics.py:", "elastic_control/evaluation/"))]
    assert outside == [], "AUC is computed in elastic_control/metrics.py only"
    assert "elastic_control/metrics.py:auc" in defined
    assert "elastic_control.training.metrics" not in _imports(REPO / "elastic_control" / "data" / "synth.py")


def test_one_free_port_helper_in_the_tests():
    """Tests take ports from helpers_common.free_port (below the ephemeral range, like the product)."""
    defined = [
        p.name
        for p in _sources("tests")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and "free_port" in node.name and not node.name.startswith("test_")
    ]
    assert defined == ["helpers_common.py"]
