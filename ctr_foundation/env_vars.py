"""Every environment variable ElasticCTR components read, in one typed registry.

The Kubernetes manifests and the local backend set the SAME variables, so a
component behaves the same in a pod and on a laptop. Add new variables here,
never read ``os.environ`` for a setting anywhere else.

Each variable says what kind of value it carries: a plain ``VALUE`` must be
identical in a pod and in the local plan; an ``ADDRESS`` (URL or host:port,
or a comma-separated list of them), a ``PATH``, a component's own
``LISTEN_PORT`` or ``OWN_HOST`` differ between the two but must name the same
component or file (tests/test_env_parity.py checks both); a ``SECRET`` is
never written into a plan or manifest in clear. Only variables marked
``inherit`` (the debug switch, test hooks) pass from the environment of
``elastic-control -a`` to the local components; every other one a component
gets comes from its plan, as a pod's come from its manifest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ctr_foundation import names
from ctr_foundation.errors import ConfigError

T = TypeVar("T")

VALUE = "value"
ADDRESS = "address"
PATH = "path"
LISTEN_PORT = "listen-port"
OWN_HOST = "own-host"
SECRET = "secret"
KINDS = (VALUE, ADDRESS, PATH, LISTEN_PORT, OWN_HOST, SECRET)


def _bool(text: str) -> bool:
    return text.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T | None
    doc: str
    kind: str = VALUE
    inherit: bool = False  # passed from the caller's environment to local components (else only the plan sets it)

    def get(self, environ: dict | None = None) -> T | None:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ConfigError(f"environment variable {self.name}={raw!r} is invalid: {e}") from e

    def require(self, environ: dict | None = None) -> T:
        value = self.get(environ)
        if value is None:
            raise ConfigError(f"environment variable {self.name} must be set ({self.doc})")
        return value


REGISTRY: dict[str, EnvVar] = {}


def _var(
    name: str, parse: Callable[[str], T], default: T | None, doc: str, kind: str = VALUE, *, inherit: bool = False
) -> EnvVar[T]:
    assert kind in KINDS and name not in REGISTRY, name
    var = EnvVar(name, parse, default, doc, kind, inherit)
    REGISTRY[name] = var
    return var


# Paddle fleet role variables (standard names, read by paddle itself too).
TRAINING_ROLE = _var("TRAINING_ROLE", str, None, "PSERVER or TRAINER")
PADDLE_PSERVERS_IP_PORT_LIST = _var("PADDLE_PSERVERS_IP_PORT_LIST", str, None, "host:port,... of all pservers", ADDRESS)
PADDLE_TRAINERS_NUM = _var("PADDLE_TRAINERS_NUM", int, 1, "number of trainers")
PADDLE_TRAINER_ID = _var("PADDLE_TRAINER_ID", int, 0, "this trainer's index")
PADDLE_PORT = _var("PADDLE_PORT", int, names.PSERVER_PORT, "this pserver's port", LISTEN_PORT)
POD_IP = _var("POD_IP", str, "127.0.0.1", "this pod's address", OWN_HOST)
PADDLE_TRAINER_ENDPOINTS = _var("PADDLE_TRAINER_ENDPOINTS", str, None, "host:port,... of all trainers", ADDRESS)

# ElasticCTR settings.
DATA_CONFIG = _var("ELASTIC_CTR_DATA_CONFIG", str, None, "path of data.config", PATH)
SLOT_CONF = _var("ELASTIC_CTR_SLOT_CONF", str, None, "path of slot.conf", PATH)
MODEL_PATH = _var("MODEL_PATH", str, None, "where training writes pass folders and the donefile", PATH)
# The image's compiled kernels (ctr_foundation/compiled.py), copied into NUMBA_CACHE_DIR by a pod's first kernel.
NUMBA_SEED = _var(
    "ELASTIC_CTR_NUMBA_SEED",
    str,
    None,
    "folder of compiled kernels written when the image was built, copied into an absent NUMBA_CACHE_DIR",
    PATH,
)
TOKEN = _var(
    "ELASTIC_CTR_TOKEN",
    str,
    None,
    "bearer token of every control call and file-server write, and of file-server reads outside cube/",
    SECRET,
)
DEBUG = _var("ELASTIC_CTR_DEBUG", _bool, False, "show tracebacks for errors", inherit=True)
STATE_DIR = _var("ELASTIC_CTR_STATE_DIR", str, ".elastic-ctr", "state folder of rendered manifests and local runs")
MLFLOW_TRACKING_URI = _var("MLFLOW_TRACKING_URI", str, None, "MLflow tracking server or store URI", ADDRESS)
FILESERVER_URL = _var("ELASTIC_CTR_FILESERVER_URL", str, None, "base URL of the file server", ADDRESS)
CUBE_SERVERS = _var("ELASTIC_CTR_CUBE_SERVERS", str, None, "comma-separated cube-server URLs, shard order", ADDRESS)
CUBE_AGENTS = _var("ELASTIC_CTR_CUBE_AGENTS", str, None, "comma-separated cube-agent URLs, shard order", ADDRESS)
CUBE_ROOT = _var("ELASTIC_CTR_CUBE_ROOT", str, None, "folder holding cube/VERSION/ shard files", PATH)
SERVING_URL = _var("ELASTIC_CTR_SERVING_URL", str, None, "base URL of the serving process", ADDRESS)
SERVING_GRPC = _var("ELASTIC_CTR_SERVING_GRPC", str, None, "HOST:PORT of serving's gRPC API (the client)", ADDRESS)

# Listening ports and per-component settings; the Kubernetes manifests set
# these (the defaults are the ports of ctr_foundation.names, the original elastic-control.sh's, so a
# program that only uses its default still listens where its Service points).
FILESERVER_PORT = _var(
    "ELASTIC_CTR_FILESERVER_PORT", int, names.FILESERVER_PORT, "file server listening port", LISTEN_PORT
)
FILESERVER_ROOT = _var("ELASTIC_CTR_FILESERVER_ROOT", str, None, "folder the file server serves and writes", PATH)
SERVING_PORT = _var("ELASTIC_CTR_SERVING_PORT", int, names.SERVING_PORT, "serving listening port", LISTEN_PORT)
SERVING_GRPC_PORT = _var(
    "ELASTIC_CTR_SERVING_GRPC_PORT", int, names.SERVING_GRPC_PORT, "serving's gRPC listening port", LISTEN_PORT
)
SERVING_SPLIT = _var(
    "ELASTIC_CTR_SERVING_SPLIT", str, None, "serving's A/B split at start, e.g. 'challenger=pass-20200101-05:10'"
)
CUBE_SERVER_PORT = _var(
    "ELASTIC_CTR_CUBE_SERVER_PORT", int, names.CUBE_SERVER_PORT, "cube-server listening port", LISTEN_PORT
)
CUBE_AGENT_PORT = _var(
    "ELASTIC_CTR_CUBE_AGENT_PORT", int, names.CUBE_AGENT_PORT, "cube-agent listening port", LISTEN_PORT
)
CUBE_TRANSFER_PORT = _var(
    "ELASTIC_CTR_CUBE_TRANSFER_PORT", int, names.CUBE_TRANSFER_PORT, "cube-transfer listening port", LISTEN_PORT
)
CUBE_SHARD = _var("ELASTIC_CTR_CUBE_SHARD", int, None, "this cube server/agent's shard index")
CUBE_SHARDS = _var("ELASTIC_CTR_CUBE_SHARDS", int, None, "number of cube shards")
CUBE_SERVER_URL = _var("ELASTIC_CTR_CUBE_SERVER_URL", str, None, "cube-agent: URL of the cube-server it feeds", ADDRESS)
APPLY_TIMEOUT = _var("ELASTIC_CTR_APPLY_TIMEOUT", float, 600.0, "-a: seconds to wait for pods to run")
CUBE_KEEP_VERSIONS = _var("ELASTIC_CTR_CUBE_KEEP", int, 3, "cube versions cube-transfer keeps (the rest are deleted)")
PROMOTION_GATE_COMMAND = _var(
    "ELASTIC_CTR_PROMOTION_GATE_COMMAND", str, None, "command cube-transfer runs to decide the promotion gate"
)
PROMOTION_GATE = _var(
    "ELASTIC_CTR_PROMOTION_GATE", str, None, "promotion gate rule cube-transfer applies before a rollout"
)
CUBE_SERVER_WORKERS = _var("ELASTIC_CTR_CUBE_SERVER_WORKERS", int, 1, "cube-server worker processes sharing its port")
TEMPLATE_DIR = _var(
    "ELASTIC_CTR_TEMPLATE_DIR",
    str,
    None,
    "folder of the Jinja2 manifest templates (default: the templates inside the package)",
    PATH,
)

# Settings of the tools the pipeline runs (read by them, set by both backends).
MLFLOW_SERVER_ENABLE_JOB_EXECUTION = _var(
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION",
    str,
    None,
    "MLflow server: 'false' turns off its background job runner (a pool of processes the pipeline never uses)",
)

# Paddle's MKL (read by MKL itself); serving sets a default (inference/scoring.py: prefer_fast_mkl).
MKL_DEBUG_CPU_TYPE = _var(
    "MKL_DEBUG_CPU_TYPE", str, None, "MKL's kernel choice; serving sets 5 (AVX2) on AMD CPUs unless given", inherit=True
)

# Where the Kubernetes client finds a cluster (read by kube/target.py and kube/adaptor.py only).
KUBECONFIG = _var("KUBECONFIG", str, None, "kubeconfig file(s), os.pathsep-separated", PATH, inherit=True)
KUBERNETES_SERVICE_HOST = _var(
    "KUBERNETES_SERVICE_HOST", str, None, "set inside a pod: the in-cluster API server", ADDRESS
)
KUBERNETES_SERVICE_PORT = _var("KUBERNETES_SERVICE_PORT", str, "443", "set inside a pod: the API server's port")

# Data credentials: from the Secret JOB-credentials in pods (data.config there reads it as ${HDFS_UGI:-}).
HDFS_UGI = _var("HDFS_UGI", str, None, "HDFS user (and password) as 'user,password'", SECRET)

# Test hooks: a component exits at a given point, as a machine failure would (tests set them, never a plan).
TEST_CRASH_EXPORT = _var(
    "ELASTIC_CTR_TEST_CRASH_EXPORT",
    str,
    None,
    "trainer 0 exits during a pass export: STAGE or STAGE:PASS (after_sparse, before_rename, before_donefile)",
    inherit=True,
)
CUBE_TEST_CRASH = _var(
    "ELASTIC_CTR_CUBE_TEST_CRASH", str, None, "cube-transfer exits mid-rollout: after-first-activate", inherit=True
)
TEST_FULL_SAVE = _var(
    "ELASTIC_CTR_TEST_FULL_SAVE",
    str,
    None,
    "trainer 0 also saves the whole pserver table (mode 0) into DIR/PASS after each incremental export, so "
    "tests can compare it with the pass chain",
    PATH,
    inherit=True,
)


def planned_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without the registry's variables a plan sets (the ``inherit`` ones stay).

    What a local component starts from before its plan's variables are added,
    so a value exported in the user's shell never changes a component behind
    its plan's back (a pod does not see that shell either).
    """
    return {k: v for k, v in environ.items() if k not in REGISTRY or REGISTRY[k].inherit}
