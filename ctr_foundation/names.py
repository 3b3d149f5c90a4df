"""Names every part agrees on: default ports, state-folder files, file-server paths.

One owner for each of these facts: the Kubernetes manifests, the local
backend, the components' own defaults and the client all read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The loopback address local components bind and containers of one pod reach each other on.
LOOPBACK = "127.0.0.1"

# ---- ports (the original elastic-control.sh's, so its users' firewalls and Services still fit) ----
FILESERVER_PORT = 8080
SERVING_PORT = 8010
SERVING_GRPC_PORT = 8011
CUBE_SERVER_PORT = 8027
CUBE_AGENT_PORT = 8001
CUBE_TRANSFER_PORT = 8099
MLFLOW_PORT = 8111
PSERVER_PORT = 30240
TRAINER_PORT = 30241
# pserver 0 hosts the trainers' barrier service on its own port + this offset.
COORDINATOR_PORT_OFFSET = 1

# ---- file-server paths ---------------------------------------------------------------
REMOTE_SLOT_CONF = "config/slot.conf"
REMOTE_DATA_CONFIG = "config/data.config"
CUBE_PREFIX = "cube"  # cube/VERSION/{shard-I.arrow, manifest.json, dense/, meta.json}
CURRENT_FILE = "current.json"  # the active cube version record, in CUBE_ROOT and on the file server
REMOTE_CURRENT = f"{CUBE_PREFIX}/{CURRENT_FILE}"
# Folders the file server lets anyone read (agents and serving fetch models and shards there);
# every other read (config/ holds data.config with credentials) needs the token.
FILESERVER_PUBLIC_PREFIXES = (CUBE_PREFIX,)
# GET /files/logs/POD/...: the training pods' kept logs, read-only, with the token (the file server's
# --kept-logs folder, not its root).
KEPT_LOGS_PREFIX = "logs"

# ---- the state folder (``-r`` writes it, ``-a``/``-l``/``-c``/``status`` read it) -----------
DEFAULT_STATE_DIR = ".elastic-ctr"
PLAN_FILE = "plan.json"
TOKEN_FILE = "token"
SLOT_CONF_FILE = "slot.conf"
DATA_CONFIG_FILE = "data.config"
MANIFEST_DIR = "manifests"
LOG_DIR = "logs"
CLIENT_CONFIG_FILE = "client.json"
CLIENT_SLOT_CONF = "client/slot.conf"


@dataclass(frozen=True)
class StateFolder:
    """Every path inside a state folder::

    STATE/
      plan.json, token, slot.conf, data.config     written by -r
      manifests/NN-*.yaml                           every Kubernetes manifest (-r, any backend)
      client.json, client/slot.conf                 written by -c
      local/components.json                         the local plan: processes, ports, variables (-r)
      local/data.config                             data.config as local components read it (-r)
      local/credentials.json                        its credentials (HDFS_UGI), mode 0600, when it has any
      local/runtime.json                            the supervisor's live record (-a)
      local/rollouts.json                           each model version served and its freshness
      local/supervisor.lock                         held by the running supervisor
      logs/NAME.log                                 one log per component, logs/supervisor.log
      files/  cube/  cube-agent-I/  mlflow/  models/  component data (kept by delete)
    """

    state: Path

    @classmethod
    def of(cls, state_dir: str | Path) -> StateFolder:
        return cls(Path(state_dir).resolve())

    # written by -r
    @property
    def plan_file(self) -> Path:
        return self.state / PLAN_FILE

    @property
    def token_file(self) -> Path:
        return self.state / TOKEN_FILE

    @property
    def slot_conf(self) -> Path:
        return self.state / SLOT_CONF_FILE

    @property
    def data_config(self) -> Path:
        return self.state / DATA_CONFIG_FILE

    @property
    def manifest_dir(self) -> Path:
        return self.state / MANIFEST_DIR

    # written by -c
    @property
    def client_config(self) -> Path:
        return self.state / CLIENT_CONFIG_FILE

    @property
    def client_slot_conf(self) -> Path:
        return self.state / CLIENT_SLOT_CONF

    # the local backend
    @property
    def local_dir(self) -> Path:
        return self.state / "local"

    @property
    def components_file(self) -> Path:
        return self.local_dir / "components.json"

    @property
    def local_data_config(self) -> Path:
        return self.local_dir / DATA_CONFIG_FILE

    @property
    def credentials_file(self) -> Path:
        """data.config's credentials (HDFS_UGI), mode 0600: the supervisor hands them to the components."""
        return self.local_dir / "credentials.json"

    @property
    def runtime_file(self) -> Path:
        return self.local_dir / "runtime.json"

    @property
    def rollouts_file(self) -> Path:
        return self.local_dir / "rollouts.json"

    @property
    def lock_file(self) -> Path:
        return self.local_dir / "supervisor.lock"

    @property
    def stop_request_file(self) -> Path:
        return self.local_dir / "stop-requested"

    @property
    def logs_dir(self) -> Path:
        return self.state / LOG_DIR

    def log_path(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"

    @property
    def supervisor_log(self) -> Path:
        return self.log_path("supervisor")

    @property
    def fileserver_root(self) -> Path:
        return self.state / "files"

    @property
    def cube_root(self) -> Path:
        return self.state / "cube"

    def agent_dir(self, shard: int) -> Path:
        return self.state / f"cube-agent-{shard}"

    @property
    def mlflow_dir(self) -> Path:
        return self.state / "mlflow"

    @property
    def serving_cache(self) -> Path:
        return self.state / "serving-cache"

    @property
    def default_model_path(self) -> Path:
        return self.state / "models"
