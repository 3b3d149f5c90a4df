"""What one role process needs, read once from the environment (elastic_control/env_vars.py) and flags."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ctr_foundation import env_vars
from ctr_foundation.errors import ConfigError
from elastic_control.config.data_config import DataConfig, load_data_config
from elastic_control.config.slot_conf import SlotConf, load_slot_conf
from elastic_control.training.model import DEFAULT_EMBEDDING_DIM


@dataclass(frozen=True)
class Hyperparameters:
    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    # 128, not 512: one hour of data is one pass, and the MLP needs optimizer steps more than big
    # batches (synthetic held-out AUC 0.801 at 128, 0.795-0.800 at 256, 0.777 at 512; Bayes 0.818).
    batch_size: int = 128
    learning_rate: float = 1e-3  # dense tower (Adam on the pservers)
    sparse_learning_rate: float = 0.02  # embeddings (sparse Adam rule on the pservers)
    log_every: int = 50  # steps between progress lines and MLflow step metrics
    golden_lines: int = 256  # held-out lines per pass scored into golden.jsonl
    golden_stride: int = 20  # trainer 0 holds out every Nth line of its share until it has enough
    dense_pull_every: int = 1  # steps between pulls of the dense parameters from the servers
    wait_timeout: float | None = None  # ONLINE=1: give up waiting for an hour after this many seconds
    poll_seconds: float = 10.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RoleSettings:
    role: str  # PSERVER | TRAINER
    pserver_endpoints: str
    trainers: int
    trainer_id: int
    pod_ip: str
    port: int
    data_config: DataConfig
    slot_conf: SlotConf
    model_path: str
    hyper: Hyperparameters

    @property
    def pservers(self) -> int:
        return len(self.pserver_endpoints.split(","))

    @property
    def is_chief(self) -> bool:
        return self.role == "TRAINER" and self.trainer_id == 0


def role_settings_from_env(hyper: Hyperparameters, environ=None) -> RoleSettings:
    """Validate every variable a role needs; ConfigError naming the first one missing or wrong."""
    env = os.environ if environ is None else environ
    role = (env_vars.TRAINING_ROLE.require(env) or "").upper()
    if role not in ("PSERVER", "TRAINER"):
        raise ConfigError(f"TRAINING_ROLE={role!r} must be PSERVER or TRAINER")
    data_config = load_data_config(env_vars.DATA_CONFIG.require(env), env)
    slot_conf = load_slot_conf(env_vars.SLOT_CONF.require(env))
    model_path = env_vars.MODEL_PATH.get(env) or data_config.model_path
    if not model_path:
        raise ConfigError("MODEL_PATH is not set (environment or data.config): where should passes be written?")
    trainers = env_vars.PADDLE_TRAINERS_NUM.get(env)
    trainer_id = env_vars.PADDLE_TRAINER_ID.get(env)
    if role == "TRAINER" and not 0 <= trainer_id < trainers:
        raise ConfigError(f"PADDLE_TRAINER_ID={trainer_id} must be in 0..PADDLE_TRAINERS_NUM-1 ({trainers - 1})")
    return RoleSettings(
        role=role,
        pserver_endpoints=env_vars.PADDLE_PSERVERS_IP_PORT_LIST.require(env),
        trainers=trainers,
        trainer_id=trainer_id,
        pod_ip=env_vars.POD_IP.get(env),
        port=env_vars.PADDLE_PORT.get(env),
        data_config=data_config,
        slot_conf=slot_conf,
        model_path=model_path,
        hyper=hyper,
    )
