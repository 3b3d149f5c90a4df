"""Where the local backend keeps things inside the state folder.

STATE/
  plan.json, token, slot.conf, data.config     written by -r (elastic_control.plan)
  local/components.json                         the local plan: every process, its ports and variables (-r)
  local/runtime.json                            the supervisor's live record: PIDs, states, restarts (-a)
  local/rollouts.json                           each model version served and its freshness
  local/supervisor.lock                         held by the running supervisor
  logs/NAME.log                                 one log per component, logs/supervisor.log
  client.json                                   written by -c
  files/  cube/  cube-agent-I/  mlflow/         component data (kept by delete)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic_control.plan import LOG_DIR


@dataclass(frozen=True)
class LocalLayout:
    state: Path

    @classmethod
    def of(cls, state_dir) -> LocalLayout:
        return cls(Path(state_dir).resolve())

    @property
    def local_dir(self) -> Path:
        return self.state / "local"

    @property
    def components_file(self) -> Path:
        return self.local_dir / "components.json"

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
    def client_config(self) -> Path:
        return self.state / "client.json"

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
    def default_model_path(self) -> Path:
        return self.state / "models"
