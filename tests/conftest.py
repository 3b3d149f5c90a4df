"""Suite-wide fixtures and markers.

Passes: the session fixtures below train with the product trainer
(`elastic-control train`, see helpers_passes.py), once per test run, and the
cube, serving and evaluation tests share them. They are read-only: a test that
changes passes works on ``world.copy_models(tmp_path / ...)``.

Environment markers: a test that needs something the machine may lack says so
with one of the markers in ENVIRONMENT (``@pytest.mark.needs_root``, ...); it
is skipped, with the reason, where the need is not met. These are the only
skips: a product failure (an import error, a process that does not come up)
fails the test.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers_common import CRITEO_FILE, PYTHON, REPO, free_port, process, wait_healthy

VOLCANO_SCHEMAS = REPO.parent / "shared" / "schemas" / "volcano"

# A `serve` a test starts without --grpc-port takes a free gRPC port, not the fixed default 8011 (which two test
# runs, or a test run and a benchmark, on one machine would both bind). Tests of the gRPC front end, the local
# backend and the rendered pods set the port explicitly.
os.environ.setdefault("ELASTIC_CTR_SERVING_GRPC_PORT", "0")

# marker -> (is the need unmet?, reason shown by -ra)
ENVIRONMENT = {
    "needs_criteo": (
        lambda: not CRITEO_FILE.exists(),
        f"the real Criteo lines are not at {CRITEO_FILE} (the shared data folder beside the repo)",
    ),
    "needs_root": (lambda: os.geteuid() != 0, "needs root (network namespaces, veth pairs, unshare -m)"),
    "needs_redis": (
        lambda: shutil.which("redis-server") is None,
        "redis-server is not installed (scripts/setup.sh installs it when run as root)",
    ),
    "needs_venv": (
        lambda: not (REPO / ".venv" / "bin" / "elastic-control").exists(),
        "the project's .venv is not set up (bash scripts/setup.sh)",
    ),
    "needs_ruff": (
        lambda: not Path(sys.executable).with_name("ruff").exists(),
        "ruff is installed by scripts/setup.sh (requirements-dev.txt)",
    ),
    "needs_promtool": (
        lambda: shutil.which("promtool") is None,
        "promtool is not installed (Debian's prometheus package ships it: apt-get install prometheus)",
    ),
    "needs_volcano_schemas": (
        lambda: not VOLCANO_SCHEMAS.is_dir(),
        f"the real Volcano CRD schemas are not at {VOLCANO_SCHEMAS} (the shared schemas folder)",
    ),
}


def pytest_configure(config):
    for name, (_, reason) in ENVIRONMENT.items():
        config.addinivalue_line("markers", f"{name}: skipped unless met ({reason})")


def pytest_collection_modifyitems(config, items):
    unmet = {name: reason for name, (check, reason) in ENVIRONMENT.items() if check()}
    for item in items:
        for name, reason in unmet.items():
            if item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))


# ---- passes written by the product trainer ------------------------------------------------------


@pytest.fixture(scope="session")
def synth_world(tmp_path_factory):
    """Synthetic data (`elastic-control data synth`, 4 hours) and two consecutive passes trained on its first
    two hours by `elastic-control train`; the last two hours are held out."""
    import helpers_passes

    return helpers_passes.session_synth_world(tmp_path_factory)


@pytest.fixture(scope="session")
def shuffled_world(tmp_path_factory, synth_world):
    """One pass trained by `elastic-control train` on the synthetic first hour with its clicks shuffled."""
    import helpers_passes

    return helpers_passes.shuffled_label_world(tmp_path_factory.mktemp("shuffled-world"), synth_world)


@pytest.fixture(scope="session")
def criteo_world(tmp_path_factory):
    """One pass trained by `elastic-control train` on real Criteo lines (39 slots) with SPARSE_DIM.

    Tests using it carry ``needs_criteo``."""
    import helpers_passes

    return helpers_passes.criteo_world(tmp_path_factory.mktemp("criteo-world"))


# ---- the container image ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def image():
    """``elastic-ctr:VERSION`` built from the Dockerfile once per test run (tests/test_image.py, the pod
    harness's image runtime); skipped with "podman not available" without podman. Its finalizer removes
    the pod harness's containers this test process (or a dead one) left."""
    if shutil.which("podman") is None:
        pytest.skip("podman not available")
    from helpers_image import build_image
    from pod_harness.podman import remove_leftovers

    built = build_image()
    yield built
    remove_leftovers(built.env, owner=os.getpid())


# ---- a real MLflow tracking server ------------------------------------------------------------------------


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` (SQLite store, proxied artifacts) on a free loopback port."""
    port = free_port()
    root = tmp_path / "mlflow-server"
    root.mkdir()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    argv = [PYTHON, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port, "--workers", 1]
    argv += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", root / "artifacts"]
    with process([*argv, "--serve-artifacts"], env=env, log_path=root / "server.log", start_new_session=True) as proc:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout=120, path="/health")
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"mlflow server: {e}: {(root / 'server.log').read_text()[-2000:]}")
        yield url, root
