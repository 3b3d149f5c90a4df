"""The local plan: every component of the pipeline as a process, on free loopback ports.

Each component gets the SAME entry point and the SAME environment variables
as its container in the Kubernetes manifests (elastic_control/kube/templates/*.yaml.j2), with
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

from ctr_foundation import env_vars as ev
from ctr_foundation.names import COORDINATOR_PORT_OFFSET, StateFolder
from elastic_control.config import DataConfig
from elastic_control.local.ports import LOOPBACK, free_ports
from elastic_control.local.spec import JOB, SERVICE, ComponentSpec, LocalPlan
from elastic_control.plan import Plan

DEFAULT_MAX_JOB_RESTARTS = 3  # as the Volcano job's maxRetry

MLFLOW = "mlflow"
FILESERVER = "fileserver"
TRANSFER = "cube-transfer"
SERVING = "serving"


def cube_server_name(shard: int) -> str:
    return f"cube-server-{shard}"


def cube_agent_name(shard: int) -> str:
    return f"cube-agent-{shard}"


def pserver_name(index: int) -> str:
    return f"pserver-{index}"


def trainer_name(index: int) -> str:
    return f"trainer-{index}"


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


# data.config keys that are credentials: the components get them in their environment from the supervisor
# (as pods from a Secret), and their data.config says ${KEY:-}, so neither it nor the file server holds them.
CREDENTIAL_KEYS = (ev.HDFS_UGI.name,)


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


def draw_ports(services: int, pservers: int, trainers: int) -> tuple[list[int], list[int], list[int]]:
    """(service ports, pserver ports, trainer ports), all distinct and free now.

    pserver 0's port P comes with P + COORDINATOR_PORT_OFFSET (its barrier service) free and unused too.
    """
    width = COORDINATOR_PORT_OFFSET + 1
    (first_pserver,) = free_ports(1, width=width)
    block = set(range(first_pserver, first_pserver + width))
    rest = free_ports(services + pservers - 1 + trainers, exclude=block)
    services_ports, rest = rest[:services], rest[services:]
    return services_ports, [first_pserver, *rest[: pservers - 1]], rest[pservers - 1 :]


def training_job_components(
    *,
    pservers: int,
    trainers: int,
    pserver_ports: list[int],
    trainer_ports: list[int],
    model_path: str,
    data_config: str,
    slot_conf: str,
    extra_env: dict[str, str] | None = None,
    argv: list[str] | None = None,
    after: list[str] | None = None,
    credentials: list[str] | tuple[str, ...] = (),
) -> list[ComponentSpec]:
    """The training job (P pservers, T trainers) as JOB components; the pipeline's and `train`'s alike.

    Every member runs ``elastic-control role`` with the standard Paddle variables, as a pod of the Volcano job does.
    """
    pserver_list = ",".join(f"{LOOPBACK}:{p}" for p in pserver_ports)
    trainer_list = ",".join(f"{LOOPBACK}:{p}" for p in trainer_ports)
    job_env = {
        ev.PADDLE_PSERVERS_IP_PORT_LIST.name: pserver_list,
        ev.PADDLE_TRAINER_ENDPOINTS.name: trainer_list,
        ev.PADDLE_TRAINERS_NUM.name: str(trainers),
        ev.POD_IP.name: LOOPBACK,
        ev.MODEL_PATH.name: model_path,
        **(extra_env or {}),
        ev.SLOT_CONF.name: slot_conf,
        ev.DATA_CONFIG.name: data_config,
    }
    comps = []
    for role, role_ports, name in (("PSERVER", pserver_ports, pserver_name), ("TRAINER", trainer_ports, trainer_name)):
        for i, port in enumerate(role_ports):
            coordinator = role == "PSERVER" and i == 0
            comps.append(
                ComponentSpec(
                    name=name(i),
                    kind=role.lower(),
                    group=JOB,
                    secrets=[ev.TOKEN.name, *credentials],
                    port=port,
                    # pserver 0 also serves the trainers' barriers on its port + COORDINATOR_PORT_OFFSET.
                    extra_ports=[port + COORDINATOR_PORT_OFFSET] if coordinator else [],
                    ready="none",
                    after=list(after or []),
                    argv=list(argv or elastic_control_argv("role")),
                    env={
                        **job_env,
                        ev.TRAINING_ROLE.name: role,
                        ev.PADDLE_PORT.name: str(port),
                        ev.PADDLE_TRAINER_ID.name: str(i),
                    },
                )
            )
    assert len(comps) == pservers + trainers
    return comps


def plan_components(
    plan: Plan,
    layout: StateFolder,
    *,
    model_path: str,
    max_job_restarts: int = DEFAULT_MAX_JOB_RESTARTS,
    window: dict | None = None,
    credentials: list[str] | tuple[str, ...] = (),
) -> LocalPlan:
    """Every component with its argv, environment and port (drawn fresh, free now)."""
    res = plan.resources
    service_ports, pserver_ports, trainer_ports = draw_ports(5 + 2 * res.cube_shards, res.pservers, res.trainers)
    take = iter(service_ports)
    mlflow_port, fileserver_port, transfer_port, serving_port = next(take), next(take), next(take), next(take)
    cube_ports = [(next(take), next(take)) for _ in range(res.cube_shards)]
    serving_grpc_port = next(take)

    def url(port: int) -> str:
        return f"http://{LOOPBACK}:{port}"

    fileserver_url, serving_url, mlflow_url = url(fileserver_port), url(serving_port), url(mlflow_port)
    cube_servers = ",".join(url(s) for s, _ in cube_ports)
    cube_agents = ",".join(url(a) for _, a in cube_ports)
    config_env = {
        ev.SLOT_CONF.name: str(layout.slot_conf),
        ev.DATA_CONFIG.name: str(layout.local_data_config),
    }
    shards = str(res.cube_shards)
    comps: list[ComponentSpec] = []

    comps.append(
        ComponentSpec(
            name=MLFLOW,
            kind="mlflow",
            port=mlflow_port,
            ready="http:/health",
            ready_timeout=180.0,
            argv=console_script("mlflow", "mlflow.cli")
            + [
                "server",
                "--host",
                LOOPBACK,
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{layout.mlflow_dir / 'mlflow.db'}",
                "--artifacts-destination",
                str(layout.mlflow_dir / "artifacts"),
                "--serve-artifacts",
            ],
            # Its background job runner forks a pool of consumers that only the GenAI features use:
            # on a 2-core machine they cost more than they give.
            env={ev.MLFLOW_SERVER_ENABLE_JOB_EXECUTION.name: "false"},
        )
    )
    comps.append(
        ComponentSpec(
            name=FILESERVER,
            kind="fileserver",
            secrets=[ev.TOKEN.name],
            port=fileserver_port,
            ready="http:/healthz",
            argv=elastic_control_argv(
                "fileserver", "--root", str(layout.fileserver_root), "--host", LOOPBACK, "--port", str(fileserver_port)
            ),
            env={ev.FILESERVER_ROOT.name: str(layout.fileserver_root), ev.FILESERVER_PORT.name: str(fileserver_port)},
        )
    )
    for shard, (server_port, agent_port) in enumerate(cube_ports):
        data_dir = str(layout.agent_dir(shard))
        comps.append(
            ComponentSpec(
                name=cube_server_name(shard),
                kind="cube-server",
                secrets=[ev.TOKEN.name],
                port=server_port,
                ready="http:/healthz",
                argv=console_script("cube-server", "cube.server")
                + ["--host", LOOPBACK, "--port", str(server_port), "--shard", str(shard), "--data", data_dir],
                env={
                    ev.CUBE_SHARD.name: str(shard),
                    ev.CUBE_SHARDS.name: shards,
                    ev.CUBE_ROOT.name: data_dir,
                    ev.CUBE_SERVER_PORT.name: str(server_port),
                },
                make_dirs=[data_dir],
            )
        )
        comps.append(
            ComponentSpec(
                name=cube_agent_name(shard),
                kind="cube-agent",
                secrets=[ev.TOKEN.name],
                port=agent_port,
                ready="http:/healthz",
                after=[cube_server_name(shard), FILESERVER],
                argv=console_script("cube-agent", "cube.agent") + ["--host", LOOPBACK],
                env={
                    ev.CUBE_SHARD.name: str(shard),
                    ev.CUBE_SHARDS.name: shards,
                    ev.CUBE_ROOT.name: data_dir,
                    ev.CUBE_AGENT_PORT.name: str(agent_port),
                    ev.CUBE_SERVER_URL.name: url(server_port),
                    ev.FILESERVER_URL.name: fileserver_url,
                },
                make_dirs=[data_dir],
            )
        )
    # Same variable as the manifest sets, only when -r was given a rule.
    gate = plan.extra.get("promotion_gate")
    gate_env = {ev.PROMOTION_GATE.name: gate} if gate else {}
    comps.append(
        ComponentSpec(
            name=TRANSFER,
            kind="cube-transfer",
            secrets=[ev.TOKEN.name, *credentials],
            port=transfer_port,
            ready="http:/healthz",
            after=[FILESERVER] + [cube_agent_name(i) for i in range(res.cube_shards)],
            # Polls the donefile every second (5 s by default): freshness is what the local pipeline shows off.
            argv=console_script("cube-transfer", "cube.transfer") + ["--host", LOOPBACK, "--poll-interval", "1"],
            env={
                ev.MODEL_PATH.name: model_path,
                ev.CUBE_ROOT.name: str(layout.cube_root),
                ev.CUBE_SHARDS.name: shards,
                ev.CUBE_AGENTS.name: cube_agents,
                ev.CUBE_SERVERS.name: cube_servers,
                ev.FILESERVER_URL.name: fileserver_url,
                ev.CUBE_TRANSFER_PORT.name: str(transfer_port),
                ev.MLFLOW_TRACKING_URI.name: mlflow_url,
                **config_env,
                **gate_env,
            },
        )
    )
    comps.append(
        ComponentSpec(
            name=SERVING,
            kind="serving",
            port=serving_port,
            extra_ports=[serving_grpc_port],
            secrets=[ev.TOKEN.name],  # split control and version pins, as the serving container gets it
            ready="http:/healthz",
            after=[FILESERVER] + [cube_server_name(i) for i in range(res.cube_shards)],
            argv=elastic_control_argv(
                "serve",
                "--host",
                LOOPBACK,
                "--port",
                str(serving_port),
                "--grpc-port",
                str(serving_grpc_port),
                "--cache-dir",
                str(layout.state / "serving-cache"),
                "--poll-interval",
                "0.5",
            ),
            env={
                ev.SERVING_PORT.name: str(serving_port),
                ev.SERVING_GRPC_PORT.name: str(serving_grpc_port),
                ev.MLFLOW_TRACKING_URI.name: mlflow_url,
                ev.CUBE_SERVERS.name: cube_servers,
                ev.FILESERVER_URL.name: fileserver_url,
                **config_env,
            },
        )
    )

    # Not after MLflow: as on the cluster, the job starts while the tracking server is still coming up
    # (its SQLite migrations take tens of seconds); MLflow's client retries meanwhile.
    comps += training_job_components(
        pservers=res.pservers,
        trainers=res.trainers,
        pserver_ports=pserver_ports,
        trainer_ports=trainer_ports,
        model_path=model_path,
        data_config=str(layout.local_data_config),
        slot_conf=str(layout.slot_conf),
        extra_env={ev.MLFLOW_TRACKING_URI.name: mlflow_url, ev.FILESERVER_URL.name: fileserver_url},
        argv=elastic_control_argv("role", *plan.training_args),
        after=[FILESERVER],
        credentials=credentials,
    )
    assert all(c.group in (JOB, SERVICE) for c in comps)
    return LocalPlan(
        components=comps,
        max_job_restarts=max_job_restarts,
        model_path=model_path,
        serving_url=serving_url,
        transfer_url=url(transfer_port),
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
