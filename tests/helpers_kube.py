"""Rendering a plan into a temporary state folder for the Kubernetes tests."""

from __future__ import annotations

from pathlib import Path

from ctr_foundation.names import MANIFEST_DIR, TOKEN_FILE
from elastic_control import api
from elastic_control.config import Resources

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_SLOT_CONF = REPO / "examples" / "slot.conf"
EXAMPLE_DATA_CONFIG = REPO / "examples" / "data.config"
FIXED_TOKEN = "golden-token-not-a-secret"


def render_plan(
    state_dir: Path, *, token: str = FIXED_TOKEN, cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5, **kwargs
):
    """`-r` as a library call with a fixed token (kept across re-renders, so pre-seeding it fixes it)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / TOKEN_FILE).write_text(token + "\n")
    kwargs.setdefault("slot_conf", str(EXAMPLE_SLOT_CONF))
    if kwargs.get("backend") == "local" and "data_config" not in kwargs:
        # The local backend's -r refuses a window with no complete hour: give it some.
        from helpers_local import example_data_config_with_data

        kwargs["data_config"] = str(example_data_config_with_data(state_dir.parent / f"{state_dir.name}-data"))
    kwargs.setdefault("data_config", str(EXAMPLE_DATA_CONFIG))
    kwargs.setdefault("backend", "k8s")
    plan = api.configure_resource(
        resources=Resources(cpu=cpu, mem=mem, trainers=trainers, pservers=pservers, cube_shards=cube_shards),
        state_dir=str(state_dir),
        **kwargs,
    )
    return plan, state_dir / MANIFEST_DIR
