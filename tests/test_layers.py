"""The layering of docs/architecture.md, checked on every import statement (module level and lazy).

Packages first (ctr_foundation < cube < client < elastic_control), then modules: each module sits on one
layer of ``LAYERS`` and imports only modules on its own layer or below.
"""

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


# Layers, bottom up: a module imports only its own layer and those below. Every `*/cli.py` (click code)
# sits with the commands, whatever folder holds it.
LAYERS = (
    ("ctr_foundation",),
    ("cube",),
    # kube/constants.py (the Kubernetes names: API groups, labels, annotations), kube/adaptor.py (the one
    # Kubernetes client) and kube/target.py (which cluster it talks to) import nothing above ctr_foundation:
    # the trainer patches its progress annotation with them.
    (
        "elastic_control.config",
        "elastic_control.metrics",
        "elastic_control.console",
        "elastic_control.kube.constants",
        "elastic_control.kube.adaptor",
        "elastic_control.kube.target",
    ),
    ("client",),
    ("elastic_control.plan", "elastic_control.data"),
    ("elastic_control.inference",),
    ("elastic_control.training", "elastic_control.fileserver"),
    ("elastic_control.serving",),
    ("elastic_control.evaluation",),
    ("elastic_control.catalogue", "elastic_control.backends"),
    ("elastic_control.local", "elastic_control.kube"),
    ("elastic_control.api",),
    ("elastic_control.cli", "elastic_control.demo", "elastic_control.tuning", "elastic_control.__main__"),
)
COMMANDS = len(LAYERS) - 1
# Imports allowed to run up a layer (at most two, each named with its reason in docs/architecture.md).
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for package in ALLOWED for p in (REPO / package).rglob("*.py")}


def layer_of(module: str) -> int | None:
    """The layer of a module (or of the package it is in); None for a package above every layer."""
    parts = module.split(".")
    if parts[0] == "elastic_control" and len(parts) == 3 and parts[2] == "cli":
        return COMMANDS
    best = max(
        ((len(p), i) for i, layer in enumerate(LAYERS) for p in layer if module == p or module.startswith(p + ".")),
        default=None,
    )
    return best[1] if best else None


def _target(module: str, known: dict[str, Path]) -> str | None:
    """The project module an import names (``from pkg import mod`` names pkg.mod)."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def upward_imports() -> list[str]:
    known = _modules()
    bad = []
    for name, path in sorted(known.items()):
        mine = layer_of(name)
        for line, imported in imported_modules(path):
            target = _target(imported, known)
            if target is None or target == name or name.startswith(target + "."):
                continue  # not the project's, or a package's own __init__
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine and (name, target) not in UPWARD_ALLOWED:
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} (layer {mine}) imports {target} (layer {theirs})")
    return sorted(set(bad))


def test_every_module_has_a_layer():
    assert [m for m in _modules() if layer_of(m) is None and m not in ALLOWED] == []


def test_no_module_imports_a_higher_layer():
    assert len(UPWARD_ALLOWED) <= 2
    assert upward_imports() == []


def test_a_lower_module_importing_a_higher_one_is_caught(tmp_path, monkeypatch):
    """The check above is not vacuous: an import of the API from the metrics module is reported."""
    real = imported_modules

    def with_one_more(path: Path):
        extra = [(1, "elastic_control.api")] if path == REPO / "elastic_control" / "metrics.py" else []
        return real(path) + extra

    monkeypatch.setitem(globals(), "imported_modules", with_one_more)
    assert upward_imports() == [
        "elastic_control/metrics.py:1: elastic_control.metrics (layer 2) imports elastic_control.api (layer 11)"
    ]


def test_no_import_circle_at_module_level():
    """Module-level imports form no circle (a circle hides behind nothing but a function-level import)."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                targets |= {_target(a.name, known) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {_target(f"{node.module}.{a.name}", known) for a in node.names}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


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
