"""Callers reach the backends only through the interface (elastic_control/backends/base.py) and the API."""

from __future__ import annotations

from pathlib import Path

from test_layers import imported_modules

REPO = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(REPO)), module)
        for path in sorted((REPO / folder).rglob("*.py"))
        for _, module in imported_modules(path)
    ]


def test_the_demo_uses_the_api_and_the_handle_not_the_local_backend():
    bad = [
        (p, m)
        for p, m in _imports("elastic_control/demo")
        if m.startswith(("elastic_control.local", "elastic_control.kube"))
    ]
    assert bad == []


def test_only_the_api_names_a_backend_implementation():
    """``api.get_backend`` picks the implementation; everything else holds a ``Backend`` or a ``Deployment``."""
    implementations = ("elastic_control.kube.backend", "elastic_control.local.backend")
    bad = [
        (p, m)
        for folder in ("elastic_control", "client", "bench")
        for p, m in _imports(folder)
        if m.startswith(implementations) and p != "elastic_control/api.py"
    ]
    assert bad == []
