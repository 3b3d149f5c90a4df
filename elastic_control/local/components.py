"""The local plan: the component catalogue (elastic_control/catalogue.py) as processes on free loopback ports.

Each component runs what its container runs in the Kubernetes manifests, with
loopback URLs and folders of the state directory in place of Services and
volumes. The write token is not written here: the supervisor reads it from
STATE/token and hands it to the components whose pods get it from the
Secret (``ComponentSpec.secrets``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from ctr_foundation.names import COORDINATOR_PORT_OFFSET, StateFolder
from elastic_control.catalogue import (
    CREDENTIAL_KEYS,
    FILESERVER,
    MLFLOW,
    PORTS,
    SERVING,
    TRANSFER,
    Component,
    Loopback,
    Paths,
    build_catalogue,
    cube_agent_name,
    cube_server_name,
    pserver_name,
    trainer_name,
)
from elastic_control.config import DataConfig
from elastic_control.local.ports import free_ports
from elastic_control.local.spec import ComponentSpec, LocalPlan
from elastic_control.plan import Plan

DEFAULT_MAX_JOB_RESTARTS = 3  # as the Volcano job's maxRetry


def console_script(name: str, module: str) -> list[str]:
    """The installed console script beside this Python, else ``python -c`` of its main()."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]


def elastic_control_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_control", *args]


def _absolute(path: str | None, base: Path) -> str | None:
    """Local relative paths are taken relative to where -r ran; URLs (hdfs://, s3://) are kept."""
    if not path or "://" in path:
        return path
    return str((base / path).resolve()) if not os.path.isabs(path) else path


def credentials_of(cfg: DataConfig) -> dict[str, str]:
    return {key: cfg.values[key] for key in CREDENTIAL_KEYS if cfg.values.get(key)}


def local_data_config(cfg: DataConfig, *, hdfs_address: str, model_path: str, base: Path) -> str:
    """data.config as the local components read it: expanded, absolute paths, MODEL_PATH set, credentials
    read from the environment."""
    values = dict(cfg.values)
    values["HDFS_ADDRESS"] = hdfs_address
    if not hdfs_address:
        values["DATASET_PATH"] = _absolute(cfg.dataset_path, base)
    values["MODEL_PATH"] = model_path
    for key in credentials_of(cfg):
        values[key] = f"${{{key}:-}}"
    return dataclasses.replace(cfg, values=values).to_text()


def resolve_model_path(cfg: DataConfig, layout: StateFolder, base: Path) -> str:
    return _absolute(cfg.model_path, base) or str(layout.default_model_path)


def training_window(cfg: DataConfig) -> dict | None:
    """The window an offline job must write a pass of (None online: the job waits for hours instead)."""
    if cfg.online:
        return None
    return {"start": cfg.format_slot(cfg.start), "end": cfg.format_slot(cfg.end), "dataset": cfg.dataset_root}


def draw_ports(
    services: int, pservers: int, trainers: int, exclude: set[int] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """(service ports, pserver ports, trainer ports), all distinct, free now and not in ``exclude``.

    pserver 0's port P comes with P + COORDINATOR_PORT_OFFSET (its barrier service) free and unused too.
    """
    width = COORDINATOR_PORT_OFFSET + 1
    exclude = set(exclude or ())
    (first_pserver,) = free_ports(1, width=width, exclude=exclude)
    block = set(range(first_pserver, first_pserver + width))
    rest = free_ports(services + pservers - 1 + trainers, exclude=block | exclude)
    services_ports, rest = rest[:services], rest[services:]
    return services_ports, [first_pserver, *rest[: pservers - 1]], rest[pservers - 1 :]


# The module whose main() each console script runs, for a Python without the scripts beside it.
SCRIPT_MODULES = {"mlflow": "mlflow.cli", "cube-server": "cube.server", "cube-agent": "cube.agent",
                  "cube-transfer": "cube.transfer"}  # fmt: skip


def local_argv(component: Component) -> list[str]:
    """The catalogue's argv for this machine: ``elastic-control`` as this Python's module, other scripts beside it."""
    if component.script == "elastic-control":
        return elastic_control_argv(*component.args)
    return console_script(component.script, SCRIPT_MODULES[component.script]) + list(component.args)


def process_spec(component: Component) -> ComponentSpec:
    """A catalogue entry as the supervisor runs it."""
    (_, port), *extra = component.ports
    return ComponentSpec(
        name=component.name,
        kind=component.kind,
        group=component.group,
        secrets=component.secrets,
        port=port,
        extra_ports=[p for _, p in extra],
        ready=f"http:{component.health}" if component.health else "none",
        ready_timeout=component.start_timeout,
        after=list(component.after),
        argv=local_argv(component),
        env=component.values,
        make_dirs=list(component.scratch),
    )


def job_ports(pservers: int, trainers: int, pserver_ports: list[int], trainer_ports: list[int]) -> dict:
    return {
        **{pserver_name(i): {"paddle": pserver_ports[i]} for i in range(pservers)},
        **{trainer_name(i): {"paddle": trainer_ports[i]} for i in range(trainers)},
    }


def local_addressing(
    plan: Plan, layout: StateFolder, *, model_path: str, keep_ports: dict[str, list[int]] | None = None
) -> Loopback:
    """Every component's ports drawn free now, except those ``keep_ports`` names (component -> its ports, in
    order: a running pipeline's); files in the state folder."""
    res = plan.resources
    kinds = [MLFLOW, FILESERVER, TRANSFER, SERVING]
    keep_ports = keep_ports or {}
    kept = {p for ports in keep_ports.values() for p in ports}
    if keep_ports.get(pserver_name(0)):
        kept |= set(range(keep_ports[pserver_name(0)][0], keep_ports[pserver_name(0)][0] + COORDINATOR_PORT_OFFSET + 1))
    service_ports, pserver_ports, trainer_ports = draw_ports(
        sum(len(PORTS[kind]) for kind in kinds) + 2 * res.cube_shards, res.pservers, res.trainers, kept
    )
    take = iter(service_ports)
    ports = {kind: {name: next(take) for name, _ in PORTS[kind]} for kind in kinds}
    for shard in range(res.cube_shards):
        ports[cube_server_name(shard)] = {"cube": next(take)}
        ports[cube_agent_name(shard)] = {"agent": next(take)}
    ports.update(job_ports(res.pservers, res.trainers, pserver_ports, trainer_ports))
    for name, old in keep_ports.items():
        if name in ports and len(old) >= len(ports[name]):  # pserver 0's list also has its barrier port (+1)
            ports[name] = dict(zip(ports[name], old, strict=False))
    paths = Paths(
        slot_conf=str(layout.slot_conf),
        data_config=str(layout.local_data_config),
        model_path=model_path,
        fileserver_root=str(layout.fileserver_root),
        mlflow_dir=str(layout.mlflow_dir),
        transfer_cube_root=str(layout.cube_root),
        serving_cache=str(layout.serving_cache),
        shard_dirs=[str(layout.agent_dir(shard)) for shard in range(res.cube_shards)],
    )
    return Loopback(ports, paths)


def plan_components(
    plan: Plan,
    layout: StateFolder,
    *,
    model_path: str,
    max_job_restarts: int = DEFAULT_MAX_JOB_RESTARTS,
    window: dict | None = None,
    credentials: list[str] | tuple[str, ...] = (),
    keep_ports: dict[str, list[int]] | None = None,
) -> LocalPlan:
    """The catalogue's components as local processes, on ports drawn fresh (free now) but those kept."""
    addressing = local_addressing(plan, layout, model_path=model_path, keep_ports=keep_ports)
    catalogue = build_catalogue(plan, addressing, credentials=credentials)
    return LocalPlan(
        components=[process_spec(c) for c in catalogue.components],
        max_job_restarts=max_job_restarts,
        model_path=model_path,
        serving_url=addressing.url(SERVING),
        transfer_url=addressing.url(TRANSFER),
        training_window=window,
    )


def publish_config(layout: StateFolder) -> None:
    """What the file server's init container does: config/slot.conf and config/data.config for -c."""
    target = layout.fileserver_root / "config"
    target.mkdir(parents=True, exist_ok=True)
    for name, source in (("slot.conf", layout.slot_conf), ("data.config", layout.local_data_config)):
        tmp = target / f".{name}.tmp"
        shutil.copyfile(source, tmp)
        os.replace(tmp, target / name)
