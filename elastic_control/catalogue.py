"""The component catalogue: what every pipeline component runs, declared once.

For each component: its name, its console script and arguments, its
environment (names from ``ctr_foundation.env_vars`` only), its ports (from
``ctr_foundation.names``), the HTTP path that answers once it is up, and what
must be up before it starts. ``build_catalogue(plan, addressing)`` fills in the
values for an addressing scheme:

- ``Loopback``: local processes, every port drawn free on 127.0.0.1, files in
  the state folder (``local/components.py`` maps the entries onto the
  supervisor's process specs);
- ``ClusterDns``: pods, fixed ports, other components through their Services
  (``JOB-NAME``) and the Volcano ``svc`` plugin's host names, files on the
  pods' volumes (``kube/render.py`` hands the entries to the templates, which
  render ``command`` and ``env`` through one macro and add only pod shape).

A value that only the pod's entry shell can know (a replica's index, from
Volcano's ``VC_TASK_INDEX``) is written as a shell expression; the templates
export such values in the entry shell.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ctr_foundation import env_vars as ev
from ctr_foundation import names
from elastic_control.plan import Plan

JOB = "job"  # the training job: a failing member restarts them all
SERVICE = "service"  # long-running, restarted alone

MLFLOW = "mlflow"
FILESERVER = "fileserver"
CUBE_SERVER = "cube-server"
CUBE_AGENT = "cube-agent"
TRANSFER = "cube-transfer"
SERVING = "serving"
PSERVER = "pserver"
TRAINER = "trainer"
ROLES = (PSERVER, TRAINER)

# Each kind's ports: (name, number). The names are the pods' containerPort names (Services and probes use them).
PORTS: dict[str, tuple[tuple[str, int], ...]] = {
    MLFLOW: (("http", names.MLFLOW_PORT),),
    FILESERVER: (("http", names.FILESERVER_PORT),),
    CUBE_SERVER: (("cube", names.CUBE_SERVER_PORT),),
    CUBE_AGENT: (("agent", names.CUBE_AGENT_PORT),),
    TRANSFER: (("http", names.CUBE_TRANSFER_PORT),),
    SERVING: (("http", names.SERVING_PORT), ("grpc", names.SERVING_GRPC_PORT)),
    PSERVER: (("paddle", names.PSERVER_PORT),),
    TRAINER: (("paddle", names.TRAINER_PORT),),
}
# data.config keys that are credentials: the components that read data get them from a Secret (pods) or from
# the supervisor (locally), and their data.config says ${KEY:-}, so neither it nor the file server holds them.
CREDENTIAL_KEYS = (ev.HDFS_UGI.name,)
# pserver 0 also serves the trainers' barriers, on its own port + COORDINATOR_PORT_OFFSET.
COORDINATOR = "coordinator"


def cube_server_name(shard: int) -> str:
    return f"{CUBE_SERVER}-{shard}"


def cube_agent_name(shard: int) -> str:
    return f"{CUBE_AGENT}-{shard}"


def pserver_name(index: int) -> str:
    return f"{PSERVER}-{index}"


def trainer_name(index: int) -> str:
    return f"{TRAINER}-{index}"


@dataclass(frozen=True)
class Env:
    """One environment variable of a component.

    ``secret``: from a Secret in a pod, from the supervisor locally, never written as a value.
    ``pod_field``: in a pod, read from the pod's own field (``status.podIP``); ``value`` is then unused there.
    """

    name: str
    value: str | None = None
    secret: bool = False
    pod_field: str | None = None

    def __post_init__(self):
        assert self.name in ev.REGISTRY, f"{self.name} is not in ctr_foundation/env_vars.py"
        assert self.secret == (ev.REGISTRY[self.name].kind == ev.SECRET), self.name

    @property
    def shell(self) -> bool:
        """Only the pod's entry shell can compute it (a replica's index)."""
        return self.value is not None and "${" in self.value


@dataclass(frozen=True)
class Component:
    name: str  # unique: the local process (and its log file); in a cluster, the container's task or pod
    kind: str  # the container's name; PORTS' key
    script: str  # the console script it runs
    args: tuple[str, ...]
    env: tuple[Env, ...]
    ports: tuple[tuple[str, int], ...]  # (name, number): the first is the one it is known by
    health: str | None = "/healthz"  # answers once the process is up (local start order, pods' liveness)
    after: tuple[str, ...] = ()  # components that must be up before it starts
    group: str = SERVICE
    scratch: tuple[str, ...] = ()  # folders it needs before it starts (a pod's emptyDir)
    start_timeout: float = 120.0

    @property
    def argv(self) -> list[str]:
        return [self.script, *self.args]

    @property
    def values(self) -> dict[str, str]:
        """The variables written into its plan (secrets are not)."""
        return {e.name: e.value for e in self.env if not e.secret}

    @property
    def secrets(self) -> list[str]:
        return [e.name for e in self.env if e.secret]

    def port(self, name: str) -> int:
        return dict(self.ports)[name]


@dataclass(frozen=True)
class Catalogue:
    components: tuple[Component, ...]
    shards: int  # the number of cube shards: derived here, from the plan, and nowhere else

    def __getitem__(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def names(self) -> list[str]:
        return [c.name for c in self.components]


@dataclass(frozen=True)
class Paths:
    """Where a component finds its files."""

    slot_conf: str
    data_config: str
    model_path: str
    # The services' (a training job alone has none).
    fileserver_root: str = ""
    mlflow_dir: str = ""
    transfer_cube_root: str = ""  # cube-transfer's builds and rollout journal
    serving_cache: str = ""
    shard_dirs: Sequence[str] = ()  # each cube shard's own folder (server and agent share it)
    # In a cluster: where the training pods keep a copy of their logs (the shared claim, which outlives
    # the pods Volcano deletes) and where the file server reads them for -l; locally the supervisor's log
    # files already outlive every process.
    kept_logs: str = ""


class Addressing:
    """How components reach each other and where they bind: ``Loopback`` or ``ClusterDns``."""

    local: bool
    bind: str  # the address a service listens on
    paths: Paths

    def port(self, name: str, port: str) -> int:
        raise NotImplementedError

    def url(self, name: str, port: str = "http") -> str:
        """How another component reaches ``name``'s ``port``."""
        raise NotImplementedError

    def sibling_url(self, name: str, port: str) -> str:
        """How a component reaches ``name`` beside it (same pod)."""
        return f"http://{names.LOOPBACK}:{self.port(name, port)}"

    def members(self, role: str, count: int) -> list[tuple[str, str]]:
        """(component name, index) of each replica a declaration stands for."""
        raise NotImplementedError

    def endpoint(self, role: str, index: int) -> str:
        """host:port of replica ``index`` of a training role, as Paddle's endpoint lists name it."""
        raise NotImplementedError

    def own_host(self, role: str, index: str) -> Env:
        """POD_IP: the host a role's replica is known by in the endpoint lists."""
        raise NotImplementedError


class Loopback(Addressing):
    """Local processes: ``ports[name][port]`` drawn free on 127.0.0.1, one process per replica."""

    local = True
    bind = names.LOOPBACK

    def __init__(self, ports: Mapping[str, Mapping[str, int]], paths: Paths):
        self.ports, self.paths = ports, paths

    def port(self, name: str, port: str) -> int:
        return self.ports[name][port]

    def url(self, name: str, port: str = "http") -> str:
        return f"http://{names.LOOPBACK}:{self.port(name, port)}"

    def members(self, role: str, count: int) -> list[tuple[str, str]]:
        return [(f"{role}-{i}", str(i)) for i in range(count)]

    def endpoint(self, role: str, index: int) -> str:
        return f"{names.LOOPBACK}:{self.port(f'{role}-{index}', 'paddle')}"

    def own_host(self, role: str, index: str) -> Env:
        return Env(ev.POD_IP.name, names.LOOPBACK)


class ClusterDns(Addressing):
    """Pods of the plan's job: fixed ports, Services ``JOB-NAME``, one pod template per training role."""

    local = False
    bind = "0.0.0.0"
    # The Volcano env plugin sets VC_TASK_INDEX after the manifest's variables: only the entry shell can read it.
    TASK_INDEX = "${VC_TASK_INDEX:?the Volcano env plugin did not set VC_TASK_INDEX}"

    def __init__(self, job: str, paths: Paths, *, mlflow_allowed_hosts: str):
        self.job, self.paths, self.mlflow_allowed_hosts = job, paths, mlflow_allowed_hosts

    @staticmethod
    def kind_of(name: str) -> str:
        return name.rstrip("0123456789").rstrip("-")

    def port(self, name: str, port: str) -> int:
        return dict(PORTS[self.kind_of(name)])[port]

    def service(self, name: str) -> str:
        """The Service in front of ``name``: a cube shard's lookups go to JOB-cube-I."""
        kind = self.kind_of(name)
        suffix = "cube" + name[len(CUBE_SERVER) :] if kind == CUBE_SERVER else name
        return f"{self.job}-{suffix}"

    def url(self, name: str, port: str = "http") -> str:
        return f"http://{self.service(name)}:{self.port(name, port)}"

    def members(self, role: str, count: int) -> list[tuple[str, str]]:
        return [(role, self.TASK_INDEX)]

    def endpoint(self, role: str, index: int) -> str:
        # The svc plugin's headless Service JOB makes each pod JOB-TASK-I.JOB.
        return f"{self.job}-{role}-{index}.{self.job}:{self.port(role, 'paddle')}"

    def own_host(self, role: str, index: str) -> Env:
        if role == PSERVER:
            # Paddle finds its own place in PADDLE_PSERVERS_IP_PORT_LIST as POD_IP:PADDLE_PORT, so a
            # pserver's POD_IP must be its host name from that list.
            return Env(ev.POD_IP.name, f"{self.job}-{role}-${{VC_TASK_INDEX}}.{self.job}")
        return Env(ev.POD_IP.name, names.LOOPBACK, pod_field="status.podIP")


def _token() -> Env:
    return Env(ev.TOKEN.name, secret=True)


def _secrets(credentials: Iterable[str]) -> list[Env]:
    return [_token()] + [Env(name, secret=True) for name in credentials]


def _config(a: Addressing) -> list[Env]:
    return [Env(ev.SLOT_CONF.name, a.paths.slot_conf), Env(ev.DATA_CONFIG.name, a.paths.data_config)]


def training_job(
    a: Addressing,
    *,
    pservers: int,
    trainers: int,
    env: Sequence[Env] = (),
    role_args: Sequence[str] = (),
    after: Sequence[str] = (),
    credentials: Iterable[str] = (),
) -> list[Component]:
    """The training job's members: ``elastic-control role`` with Paddle's variables; ``env`` before the config's."""
    credentials = list(credentials)
    common = [
        Env(ev.PADDLE_PSERVERS_IP_PORT_LIST.name, ",".join(a.endpoint(PSERVER, i) for i in range(pservers))),
        Env(ev.PADDLE_TRAINER_ENDPOINTS.name, ",".join(a.endpoint(TRAINER, i) for i in range(trainers))),
        Env(ev.PADDLE_TRAINERS_NUM.name, str(trainers)),
    ]
    out = []
    for role, count in ((PSERVER, pservers), (TRAINER, trainers)):
        # In a pod an offline window with no complete hour aborts the job (exit 2) instead of completing it
        # with no pass; locally the supervisor checks the window the job wrote (LocalPlan.training_window).
        check = ["--check-window"] if role == TRAINER and not a.local else []
        if a.paths.kept_logs:
            check += ["--keep-logs", a.paths.kept_logs]
        for name, index in a.members(role, count):
            ports = [("paddle", a.port(name, "paddle"))]
            if role == PSERVER and index in ("0", getattr(a, "TASK_INDEX", None)):
                ports.append((COORDINATOR, ports[0][1] + names.COORDINATOR_PORT_OFFSET))
            out.append(
                Component(
                    name=name,
                    kind=role,
                    script="elastic-control",
                    args=("role", *role_args, *check),
                    env=(
                        Env(ev.TRAINING_ROLE.name, role.upper()),
                        *common,
                        Env(ev.PADDLE_PORT.name, str(ports[0][1])),
                        a.own_host(role, index),
                        *env,
                        *_config(a),
                        *_secrets(credentials),
                        Env(ev.PADDLE_TRAINER_ID.name, index),
                    ),
                    ports=tuple(ports),
                    health=None,
                    after=tuple(after),
                    group=JOB,
                )
            )
    return out


def build_catalogue(plan: Plan, a: Addressing, *, credentials: Iterable[str] = ()) -> Catalogue:
    """Every component of ``plan``'s pipeline, addressed by ``a``; ``credentials``: data.config's secret keys."""
    credentials = list(credentials)
    res, p = plan.resources, a.paths
    shards = res.cube_shards
    host = ["--host", a.bind] if a.local else []  # in a pod a service listens on every interface (its default)
    mlflow_url, fileserver_url = a.url(MLFLOW), a.url(FILESERVER)
    cube_servers = ",".join(a.url(cube_server_name(i), "cube") for i in range(shards))
    cube_agents = ",".join(a.url(cube_agent_name(i), "agent") for i in range(shards))
    ports = {kind: tuple((n, a.port(kind, n)) for n, _ in PORTS[kind]) for kind in (MLFLOW, FILESERVER, TRANSFER)}
    comps = [
        Component(
            name=MLFLOW,
            kind=MLFLOW,
            script="mlflow",
            args=(
                "server",
                "--host",
                a.bind,
                "--port",
                str(a.port(MLFLOW, "http")),
                # One trainer logs; the SQLite store takes one writer anyway.
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{p.mlflow_dir}/mlflow.db",
                "--artifacts-destination",
                f"{p.mlflow_dir}/artifacts",
                "--serve-artifacts",
                # MLflow 3 refuses API calls whose Host header it does not know (DNS-rebinding protection).
                *([] if a.local else ["--allowed-hosts", a.mlflow_allowed_hosts]),
            ),
            # Its background job runner forks a pool of consumers that only the GenAI features use.
            env=(Env(ev.MLFLOW_SERVER_ENABLE_JOB_EXECUTION.name, "false"),),
            ports=ports[MLFLOW],
            health="/health",
            start_timeout=180.0,  # its SQLite migrations take tens of seconds
        ),
        Component(
            name=FILESERVER,
            kind=FILESERVER,
            script="elastic-control",
            args=(
                "fileserver",
                "--root",
                p.fileserver_root,
                *host,
                "--port",
                str(a.port(FILESERVER, "http")),
                *(["--kept-logs", p.kept_logs] if p.kept_logs else []),
            ),
            env=(
                _token(),
                Env(ev.FILESERVER_ROOT.name, p.fileserver_root),
                Env(ev.FILESERVER_PORT.name, str(a.port(FILESERVER, "http"))),
            ),
            ports=ports[FILESERVER],
        ),
    ]
    for shard in range(shards):
        server, agent, data = cube_server_name(shard), cube_agent_name(shard), p.shard_dirs[shard]
        shard_env = (
            Env(ev.CUBE_SHARD.name, str(shard)),
            Env(ev.CUBE_SHARDS.name, str(shards)),
            Env(ev.CUBE_ROOT.name, data),
        )
        server_port, agent_port = a.port(server, "cube"), a.port(agent, "agent")
        comps += [
            Component(
                name=server,
                kind=CUBE_SERVER,
                script="cube-server",
                args=(*host, "--port", str(server_port), "--shard", str(shard), "--data", data),
                env=(*shard_env, Env(ev.CUBE_SERVER_PORT.name, str(server_port)), _token()),
                ports=(("cube", server_port),),
                scratch=(data,),
            ),
            Component(
                name=agent,
                kind=CUBE_AGENT,
                script="cube-agent",
                args=tuple(host),
                env=(
                    *shard_env,
                    Env(ev.CUBE_AGENT_PORT.name, str(agent_port)),
                    # Its own shard's server, beside it in the pod.
                    Env(ev.CUBE_SERVER_URL.name, a.sibling_url(server, "cube")),
                    Env(ev.FILESERVER_URL.name, fileserver_url),
                    _token(),
                ),
                ports=(("agent", agent_port),),
                after=(server, FILESERVER),
                scratch=(data,),
            ),
        ]
    gate = plan.extra.get("promotion_gate")
    comps.append(
        Component(
            name=TRANSFER,
            kind=TRANSFER,
            script="cube-transfer",
            # Locally it polls the donefile every second (5 s by default): freshness is what the local
            # pipeline shows off.
            args=(*host, *(["--poll-interval", "1"] if a.local else [])),
            env=(
                Env(ev.MODEL_PATH.name, p.model_path),
                Env(ev.CUBE_ROOT.name, p.transfer_cube_root),
                Env(ev.CUBE_SHARDS.name, str(shards)),
                Env(ev.CUBE_AGENTS.name, cube_agents),
                Env(ev.CUBE_SERVERS.name, cube_servers),
                Env(ev.FILESERVER_URL.name, fileserver_url),
                Env(ev.CUBE_TRANSFER_PORT.name, str(a.port(TRANSFER, "http"))),
                # The promotion gate records its decisions (gate-PASS runs) on the MLflow server.
                Env(ev.MLFLOW_TRACKING_URI.name, mlflow_url),
                *([Env(ev.PROMOTION_GATE.name, gate)] if gate else []),
                *_config(a),
                *_secrets(credentials),
            ),
            ports=ports[TRANSFER],
            after=(FILESERVER, *(cube_agent_name(i) for i in range(shards))),
        )
    )
    http, grpc = a.port(SERVING, "http"), a.port(SERVING, "grpc")
    if a.local:
        serving_args = ["--grpc-port", str(grpc), "--cache-dir", p.serving_cache, "--poll-interval", "0.5"]
    else:
        serving_args = ["--drain-delay", "5"]  # answers on while every node's proxy drops the pod
    comps.append(
        Component(
            name=SERVING,
            kind=SERVING,
            script="elastic-control",
            args=("serve", *host, "--port", str(http), *serving_args),
            env=(
                Env(ev.SERVING_PORT.name, str(http)),
                Env(ev.SERVING_GRPC_PORT.name, str(grpc)),
                Env(ev.MLFLOW_TRACKING_URI.name, mlflow_url),
                Env(ev.CUBE_SERVERS.name, cube_servers),
                Env(ev.FILESERVER_URL.name, fileserver_url),
                *_config(a),
                _token(),  # split control and version pins
            ),
            ports=(("http", http), ("grpc", grpc)),
            after=(FILESERVER, *(cube_server_name(i) for i in range(shards))),
        )
    )
    # Not after MLflow: the job starts while the tracking server is still coming up (its SQLite migrations
    # take tens of seconds); MLflow's client retries meanwhile.
    comps += training_job(
        a,
        pservers=res.pservers,
        trainers=res.trainers,
        env=(
            Env(ev.MODEL_PATH.name, p.model_path),
            Env(ev.MLFLOW_TRACKING_URI.name, mlflow_url),
            Env(ev.FILESERVER_URL.name, fileserver_url),
        ),
        role_args=plan.training_args,
        after=(FILESERVER,),
        credentials=credentials,
    )
    return Catalogue(components=tuple(comps), shards=shards)
