"""Every environment variable ElasticCTR components read, in one typed registry.

The Kubernetes manifests and the local backend set the SAME variables, so a
component behaves the same in a pod and on a laptop. Add new variables here,
never read ``os.environ`` for an ElasticCTR setting anywhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ctr_foundation import names

T = TypeVar("T")


def _bool(text: str) -> bool:
    return text.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T | None
    doc: str

    def get(self, environ: dict | None = None) -> T | None:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            from ctr_foundation.errors import ConfigError

            raise ConfigError(f"environment variable {self.name}={raw!r} is invalid: {e}") from e

    def require(self, environ: dict | None = None) -> T:
        value = self.get(environ)
        if value is None:
            from ctr_foundation.errors import ConfigError

            raise ConfigError(f"environment variable {self.name} must be set ({self.doc})")
        return value


REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, parse: Callable[[str], T], default: T | None, doc: str) -> EnvVar[T]:
    var = EnvVar(name, parse, default, doc)
    REGISTRY[name] = var
    return var


# Paddle fleet role variables (standard names, read by paddle itself too).
TRAINING_ROLE = _var("TRAINING_ROLE", str, None, "PSERVER or TRAINER")
PADDLE_PSERVERS_IP_PORT_LIST = _var("PADDLE_PSERVERS_IP_PORT_LIST", str, None, "host:port,... of all pservers")
PADDLE_TRAINERS_NUM = _var("PADDLE_TRAINERS_NUM", int, 1, "number of trainers")
PADDLE_TRAINER_ID = _var("PADDLE_TRAINER_ID", int, 0, "this trainer's index")
PADDLE_PORT = _var("PADDLE_PORT", int, names.PSERVER_PORT, "this pserver's port")
POD_IP = _var("POD_IP", str, "127.0.0.1", "this pod's address")
PADDLE_TRAINER_ENDPOINTS = _var("PADDLE_TRAINER_ENDPOINTS", str, None, "host:port,... of all trainers")

# ElasticCTR settings.
DATA_CONFIG = _var("ELASTIC_CTR_DATA_CONFIG", str, None, "path of data.config")
SLOT_CONF = _var("ELASTIC_CTR_SLOT_CONF", str, None, "path of slot.conf")
MODEL_PATH = _var("MODEL_PATH", str, None, "where training writes pass folders and the donefile")
TOKEN = _var(
    "ELASTIC_CTR_TOKEN",
    str,
    None,
    "bearer token of every control call and file-server write, and of file-server reads outside cube/",
)
DEBUG = _var("ELASTIC_CTR_DEBUG", _bool, False, "show tracebacks for errors")
STATE_DIR = _var("ELASTIC_CTR_STATE_DIR", str, ".elastic-ctr", "state folder of rendered manifests and local runs")
MLFLOW_TRACKING_URI = _var("MLFLOW_TRACKING_URI", str, None, "MLflow tracking server or store URI")
FILESERVER_URL = _var("ELASTIC_CTR_FILESERVER_URL", str, None, "base URL of the file server")
CUBE_SERVERS = _var("ELASTIC_CTR_CUBE_SERVERS", str, None, "comma-separated cube-server URLs, shard order")
CUBE_AGENTS = _var("ELASTIC_CTR_CUBE_AGENTS", str, None, "comma-separated cube-agent URLs, shard order")
CUBE_ROOT = _var("ELASTIC_CTR_CUBE_ROOT", str, None, "folder holding cube/VERSION/ shard files")
SERVING_URL = _var("ELASTIC_CTR_SERVING_URL", str, None, "base URL of the serving process")

# Listening ports and per-component settings; the Kubernetes manifests set
# these (the defaults are the ports in DESIGN.md, so a program that only uses
# its default still listens where its Service points).
FILESERVER_PORT = _var("ELASTIC_CTR_FILESERVER_PORT", int, names.FILESERVER_PORT, "file server listening port")
FILESERVER_ROOT = _var("ELASTIC_CTR_FILESERVER_ROOT", str, None, "folder the file server serves and writes")
SERVING_PORT = _var("ELASTIC_CTR_SERVING_PORT", int, names.SERVING_PORT, "serving listening port")
CUBE_SERVER_PORT = _var("ELASTIC_CTR_CUBE_SERVER_PORT", int, names.CUBE_SERVER_PORT, "cube-server listening port")
CUBE_AGENT_PORT = _var("ELASTIC_CTR_CUBE_AGENT_PORT", int, names.CUBE_AGENT_PORT, "cube-agent listening port")
CUBE_TRANSFER_PORT = _var(
    "ELASTIC_CTR_CUBE_TRANSFER_PORT", int, names.CUBE_TRANSFER_PORT, "cube-transfer listening port"
)
CUBE_SHARD = _var("ELASTIC_CTR_CUBE_SHARD", int, None, "this cube server/agent's shard index")
CUBE_SHARDS = _var("ELASTIC_CTR_CUBE_SHARDS", int, None, "number of cube shards")
CUBE_SERVER_URL = _var("ELASTIC_CTR_CUBE_SERVER_URL", str, None, "cube-agent: URL of the cube-server it feeds")
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
)
