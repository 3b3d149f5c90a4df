"""Function-level imports of project modules say why they are not at the top of the file (issue #37).

A project module is imported at the top of the file unless that would make an import circle or load a
heavy library (Paddle, MLflow, pyarrow, gRPC, ...) at import time, or slow `elastic-control --help`
(which imports every command module). Each import left inside a function carries a comment saying so,
``# function-level: <why>``, on its own line(s) or on the line above; several imports in a row may share
one comment above the first.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("elastic_control", "ctr_foundation", "cube", "client")
MARKER = "function-level"


def _is_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)


def _function_imports(tree: ast.Module):
    """Project import statements anywhere inside a function (or lambda) body."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    for func in ast.walk(tree):
        if isinstance(func, functions):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _is_project(node):
                    yield node


def _has_reason(lines: list[str], imports: dict[int, ast.stmt], node: ast.stmt) -> bool:
    """A marker comment on the statement's lines, or in the comment block right above it or above the run
    of consecutive import statements it ends."""
    if any(MARKER in line for line in lines[node.lineno - 1 : node.end_lineno] if "#" in line):
        return True
    above = node.lineno - 1  # 1-based line number of the line above
    while above >= 1:
        text = lines[above - 1].strip()
        if text.startswith("#"):  # the comment block right above (a reason may take two lines)
            while above >= 1 and lines[above - 1].strip().startswith("#"):
                if MARKER in lines[above - 1]:
                    return True
                above -= 1
            return False
        start = next((n for n in imports.values() if n.end_lineno == above), None)
        if start is None:
            return False
        if any(MARKER in line for line in lines[start.lineno - 1 : start.end_lineno] if "#" in line):
            return True
        above = start.lineno - 1
    return False


def unexplained_function_imports() -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            source = path.read_text(encoding="utf-8")
            lines = source.splitlines()
            tree = ast.parse(source, rel)
            every_import = {n.lineno: n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
            for node in _function_imports(tree):
                if not _has_reason(lines, every_import, node):
                    bad.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(bad))


def test_function_level_project_imports_say_why():
    assert unexplained_function_imports() == [], (
        "import these at the top of the file, or say why not: '# function-level: <reason>' "
        "(an import circle, a heavy library such as paddle or mlflow, `elastic-control --help` start-up)"
    )


def test_the_check_sees_an_unexplained_import(tmp_path, monkeypatch):
    """Not vacuous: an uncommented function-level import is reported, a commented one is not."""
    package = tmp_path / "cube"
    package.mkdir()
    (package / "m.py").write_text(
        "def f():\n"
        "    import os\n"
        "    from cube import a\n"
        "\n"
        "\n"
        "def g():\n"
        "    # function-level: cycle (cube.a imports this module)\n"
        "    from cube import a\n"
        "    from cube import b\n"
        "    return lambda: __import__('os')\n"
        "\n"
        "\n"
        "def h():\n"
        "    # function-level: keeps `elastic-control --help` fast (the reason may take\n"
        "    # two lines)\n"
        "    from cube import a\n"
        "    # a comment that gives no reason\n"
        "    from cube import b\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert unexplained_function_imports() == ["cube/m.py:18: from cube import b", "cube/m.py:3: from cube import a"]
