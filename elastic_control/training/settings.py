"""What one role process needs, read once from the environment (elastic_control/env_vars.py) and flags."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ctr_foundation import env_vars
from ctr_foundation.errors import ConfigError
from elastic_control.config.data_config import DataConfig, load_data_config
from elastic_control.config.slot_conf import SlotConf, load_slot_conf
from elastic_control.training.families import WIDE_FAMILIES
from elastic_control.training.model import DEFAULT_EMBEDDING_DIM, DEFAULT_HIDDEN, ModelSpec

# The defaults: wide & deep with an MLP 128-64, the decay rule on the embeddings and Adam 0.01 on the wide
# weights, count-scaled L2 2.0 on the cube rows and 5.0 on the wide weights, lines shuffled, epochs enough
# for 100 steps per trainer per pass (an hour of Criteo lines: 1; a pass of a few thousand lines: several),
# stopped early when the held-out log loss rises. Measured on the Criteo split, small Criteo slices,
# synthetic data with and without planted interactions and a public app-usage log (docs/benchmarks.md
# "Model quality"; the write-ups in CHANGELOG.md "Model quality and training defaults").
DEFAULT_MODEL = "wide_deep"
DEFAULT_EPOCHS: int | str = "auto"
DEFAULT_EARLY_STOP = True
# The wide prior's strength per earlier occurrence, p (1 - p) / 2 at a CTR of 0.25 (training/wide_prior.py):
# later passes +0.001-0.003 on the Criteo split and the two-pass small logs, throughput within the noise
# (CHANGELOG.md "The wide prior as a default").
DEFAULT_WIDE_PRIOR = 0.095


@dataclass(frozen=True)
class Hyperparameters:
    model: str | None = None  # None: MODEL of data.config, else DEFAULT_MODEL
    epochs: int | str | None = None  # None: EPOCHS of data.config, else DEFAULT_EPOCHS; "auto": see min_steps
    # EPOCHS=auto: the whole number of epochs nearest this many steps per trainer (pass_stream.planned_epochs).
    # Not "as many as the held-out lines ask for": the early stop judges a pass on lines of its own hour, and
    # on the Criteo split those asked for 7, 3 and 2 epochs of the later hours, which cost the next hour
    # 0.011 AUC (0.7524 against 0.7625), while on synthetic interaction data (independent hours) the same
    # rule gained 0.04 (docs/benchmarks.md "Model quality"). Searching it per data set is `tune`'s job.
    min_steps_per_pass: int = 100
    # EPOCHS=auto: the first pass of a fresh (not resumed) model, at least this many steps: a model starting
    # from its initialisation needs more steps than one following a new hour (synthetic gap 0.0115 -> 0.0094-
    # 0.0098, Criteo 0.7600 -> 0.7604-0.7609; early stop ends it sooner when held-out loss rises).
    min_steps_first_pass: int | None = 800
    max_epochs: int = 20  # EPOCHS=auto: at most this many
    early_stop: bool | None = None  # None: EARLY_STOP of data.config, else DEFAULT_EARLY_STOP
    # With the early stop: a pass whose last epoch is worse than its best gets the best one back
    # (training/best_epoch.py). None: on.
    restore_best_epoch: bool | None = None
    early_stop_patience: int = 2  # with a best epoch to restore: epochs no better that end a pass (best_epoch.py)
    # After each pass trainer 0 moves the logit bias so that the mean prediction on the pass's lines is their
    # click rate (training/bias_refit.py). None: on.
    refit_bias: bool | None = None
    # EPOCHS=auto with the early stop: a pass whose held-out set (trainer 0's every 20th line) is smaller
    # than this is not judged by it but trains at most ``unjudged_pass_epochs`` epochs
    # (pass_stream.unjudged_pass). 300: the eight small real logs hold out 50-250 lines a pass, where the
    # held-out loss picked epoch 1 or 2 while the test hour's AUC kept improving to epoch 3-5 (0.6904 vs
    # 0.6986 on the 2,000-line log); the Criteo split (832 lines) and the synthetic demo (625) keep it. Not
    # 500: passes of 15,000 lines (360-375 held out) then trained 3 epochs, too few for interactions:
    # synthetic interaction data 0.7733-0.7736 (logistic regression 0.7749) against 0.8078-0.8083 judged,
    # Frappe's quarter 0.9197-0.9205 against 0.9231-0.9255; a Criteo slice of the same size 0.7486 against
    # 0.7478 (logistic regression 0.7479), another 0.7576 against 0.7572 (CHANGELOG.md "Passes of 15,000
    # lines are judged by their held-out lines").
    min_holdout_to_stop: int = 300
    unjudged_pass_epochs: int = 3
    # Each hourly pass also trains one epoch over the lines of the window_hours - 1 hours before it (its
    # held-out lines and its own epochs stay its hour's). None: DEFAULT_WINDOW_HOURS (resolve_window_hours).
    window_hours: int | None = None
    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    # 128, not 512: one hour of data is one pass, and the MLP needs optimizer steps more than big
    # batches (synthetic held-out AUC 0.801 at 128, 0.795-0.800 at 256, 0.777 at 512; Bayes 0.818).
    batch_size: int = 128
    # The first pass of a fresh model: a trainer whose share has fewer than this many batches of
    # ``batch_size`` cuts smaller ones (share / this, at least pass_stream.MIN_PASS_BATCH lines; 0: always
    # ``batch_size``). 128: the Criteo split's hours (130 batches of 128 a trainer) keep 128, a
    # 4,000-line share trains batches of 31.
    min_batches_first_pass: int = 128
    # Dense tower (Adam on the pservers). 5e-4, not 1e-3: at 1e-3 the held-out loss of a small pass
    # (23 steps an epoch) blew up from its third or fourth epoch on (0.47 -> 0.65 -> 0.87, train AUC 0.95),
    # which only the copy of the best epoch kept out of the export; at 5e-4 it does not, and the four
    # judged data sets are as good (CHANGELOG.md "A calmer dense tower").
    learning_rate: float = 5e-4
    # embeddings: plain SGD on the pservers with per-key rates 0.008 / sqrt(1 + sightings / 3000), the decay
    # rule (training/rate_decay.py). Against the sparse Adam rule at 0.01 (CHANGELOG.md "The decay
    # rule"): Criteo split 0.7600 vs 0.7577-0.7587 with calibration 1.00 vs 1.09, synthetic gap 0.0115 vs
    # 0.0146, the small real logs as good and better calibrated.
    sparse_learning_rate: float = 0.008
    wide_learning_rate: float = 0.01  # embed_w: the per-key wide weight of the wide families
    sparse_optimizer: str = "decay"  # embedx_w's rule on the pservers: adam | adagrad | decay (model.SPARSE_RULES)
    # embed_w's rule: Adam. The decay rule on the wide weights too measured worse on Criteo (0.7557) and
    # no better on the synthetic gap.
    wide_optimizer: str = "adam"
    # The decay rule: rate / sqrt(1 + sightings / this) (training/rate_decay.py). None: per family
    # (resolve_decay_sightings).
    decay_sightings: float | None = None
    l2_embedding: float = 2.0  # count-scaled L2 on embedx_w (dnn: on the whole row); scikit-learn C = 1/(2 l2)
    # count-scaled L2 on embed_w (wide families). 5.0 (C = 0.1, logistic regression's best C on the Criteo
    # split), not 2.0: with the calmer dense tower and the noise-weighted early stop it puts both small real
    # logs at or above logistic regression (0.7325-0.7331 vs 0.7323, 0.7487-0.7496 vs 0.7484; at 2.0 the
    # first was 0.7302-0.7306) at no cost on the Criteo split (CHANGELOG.md).
    l2_wide: float = 5.0
    # The wide prior (training/wide_prior.py): in later passes a key's wide weight is pulled toward its
    # weight at the pass start with l2_wide + this much per earlier occurrence; 0: toward 0. None:
    # DEFAULT_WIDE_PRIOR where there is a wide weight with an L2 to strengthen, else off (resolve_wide_prior).
    wide_prior: float | None = None
    dense_l2: float = 0.0  # weight decay of the dense weights (MLP, cross layers, output)
    cross_layers: int = 2  # dcn
    cross_rank: int = 16  # dcn: rank of each cross layer's weight
    shuffle_lines: int = 100_000  # shuffle each trainer's lines within windows of this many (0: file order)
    holdout_lines: int = 2048  # trainer 0's held-out lines per pass (metrics, early stop; golden ones first)
    log_every: int = 50  # steps between progress lines and MLflow step metrics
    golden_lines: int = 256  # held-out lines per pass scored into golden.jsonl
    golden_stride: int = 20  # trainer 0 holds out every Nth line of its share until it has enough
    # Steps between pulls of the dense parameters from the servers. The pull is a round trip on every step it
    # is made (11-14% of a trainer's main thread at 1); every 4th step: examples/s +13-22% with 1 trainer,
    # +5-13% with 2, and the held-out AUC within run-to-run noise on the Criteo split, the synthetic
    # interaction data, Frappe and two small Criteo logs (CHANGELOG.md, "Two table shards a pserver").
    dense_pull_every: int = 4
    wait_timeout: float | None = None  # ONLINE=1: give up waiting for an hour after this many seconds
    poll_seconds: float = 10.0

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["hidden"] = list(self.hidden)
        return out


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

    @property
    def model_family(self) -> str:
        return resolve_model(self.hyper.model, self.data_config)

    @property
    def epochs(self) -> int | str:
        return resolve_epochs(self.hyper.epochs, self.data_config)

    @property
    def window_hours(self) -> int:
        return resolve_window_hours(self.hyper, self.data_config)

    @property
    def early_stop(self) -> bool:
        if self.hyper.early_stop is not None:
            return self.hyper.early_stop
        if self.data_config.early_stop is not None:
            return bool(self.data_config.early_stop)
        return DEFAULT_EARLY_STOP

    def model_spec(self) -> ModelSpec:
        """The network every role builds (pservers and trainers must build the same one)."""
        h = self.hyper
        return ModelSpec(
            tuple(self.slot_conf.slots),
            h.embedding_dim,
            hidden=tuple(h.hidden),
            learning_rate=h.learning_rate,
            sparse_dim=self.data_config.sparse_dim,
            sparse_learning_rate=h.sparse_learning_rate,
            family=self.model_family,
            wide_learning_rate=h.wide_learning_rate,
            sparse_optimizer=h.sparse_optimizer,
            wide_optimizer=h.wide_optimizer,
            decay_sightings=resolve_decay_sightings(h, self.model_family),
            l2_embedding=h.l2_embedding,
            l2_wide=h.l2_wide,
            wide_prior=resolve_wide_prior(h, self.model_family),
            dense_l2=h.dense_l2,
            cross_layers=h.cross_layers,
            cross_rank=h.cross_rank,
            dense_slots=tuple(self.slot_conf.dense),
        )


# The decay rule's sightings per family (resolve_decay_sightings). 3000: at 30 a key seen thousands of times
# an hour learned at a tenth of the rate and stopped short of its optimum: synthetic interaction data
# 0.7728 -> 0.8117 (logistic regression 0.7751, Bayes-optimal 0.8201), its 8-slot twin 0.8081 -> 0.8138,
# the Criteo split 0.7636 -> 0.7644, Frappe 0.9198 -> 0.9204, the small Criteo logs within 0.001
# (docs/benchmarks.md "Model quality"). deepfm keeps 30: its factorisation-machine term multiplies two
# embeddings, and at the faster rates frequent keys' embeddings grew until the logits diverged (AUC 0.50 on
# the synthetic interaction data at 300 and 3000, on the Criteo split at 3000).
DEFAULT_DECAY_SIGHTINGS = 3000.0
FAMILY_DECAY_SIGHTINGS = {"deepfm": 30.0}


def resolve_decay_sightings(hyper: Hyperparameters, family: str) -> float:
    """The decay rule's sightings: the flag, else the family's (FAMILY_DECAY_SIGHTINGS), else the default."""
    if hyper.decay_sightings is not None:
        return hyper.decay_sightings
    return FAMILY_DECAY_SIGHTINGS.get(family, DEFAULT_DECAY_SIGHTINGS)


# 1: one hour a pass. A window of 2 (the pass also trains one epoch over the hour before it) gained on a
# public app-usage log (+0.004, two runs each) but not beyond the run-to-run noise on the Criteo split, the
# small logs (-0.0007 to -0.0023) or the synthetic interaction data (docs/benchmarks.md "Model quality"), so
# it is an option `tune` searches, not a default.
DEFAULT_WINDOW_HOURS = 1


def resolve_window_hours(hyper: Hyperparameters, data_config: DataConfig) -> int:
    """Hours each pass trains on: the flag, else DEFAULT_WINDOW_HOURS; 1 where a pass is not one hour
    (PASS_HOURS, PASS_MINUTES) or admission counts sightings (ADMIT_MIN_COUNT: a replayed line would count
    twice). An explicit window above 1 there is refused."""
    why = (
        f"PASS_HOURS={data_config.pass_hours}"
        if data_config.pass_hours > 1
        else f"PASS_MINUTES={data_config.pass_minutes}"
        if data_config.pass_minutes
        else f"ADMIT_MIN_COUNT={data_config.admit_min_count}"
        if data_config.admit_min_count
        else None
    )
    if why is None:
        return hyper.window_hours or DEFAULT_WINDOW_HOURS
    if hyper.window_hours and hyper.window_hours > 1:
        raise ConfigError(
            f"--window-hours {hyper.window_hours} with {why}: the window replays whole earlier hours, which "
            "only hourly passes without admission have (use --window-hours 1)"
        )
    return 1


def resolve_model(flag: str | None, data_config: DataConfig) -> str:
    """The model family: the flag, else data.config's MODEL, else the default."""
    return flag or data_config.model or DEFAULT_MODEL


def resolve_epochs(flag: int | str | None, data_config: DataConfig) -> int | str:
    """Epochs per pass: the flag, else data.config's EPOCHS, else the default; 1 with ADMIT_MIN_COUNT.

    Admission counts a feasign's sightings as the pushes the parameter servers count (``show``), one
    per epoch: with several epochs a feasign seen once in the data would pass ADMIT_MIN_COUNT=N after N
    epochs. So with admission on, ``auto`` is one epoch and an explicit EPOCHS above 1 is refused.
    """
    setting = flag or data_config.epochs or DEFAULT_EPOCHS
    if data_config.admit_min_count:
        if setting != "auto" and int(setting) > 1:
            raise ConfigError(
                f"EPOCHS={setting} with ADMIT_MIN_COUNT={data_config.admit_min_count}: admission counts one "
                "sighting per epoch, so a pass trains one epoch when admission is on (set EPOCHS=1 or auto)"
            )
        return 1
    return setting


def resolve_wide_prior(hyper: Hyperparameters, family: str) -> float:
    """The wide prior's strength: the flag, else DEFAULT_WIDE_PRIOR for a family with a wide weight and an
    L2 on it (the prior strengthens that L2), else 0 (off). check_wide_prior refuses a flag that would do
    nothing; the default just stays off there."""
    if hyper.wide_prior is not None:
        return hyper.wide_prior
    return DEFAULT_WIDE_PRIOR if family in WIDE_FAMILIES and hyper.l2_wide else 0.0


def check_wide_prior(hyper: Hyperparameters, data_config: DataConfig) -> None:
    """An explicit --wide-prior acts on the wide weight's L2: refuse it where there is none (it would do
    nothing). The default (None) resolves per family instead (resolve_wide_prior)."""
    if not hyper.wide_prior:
        return
    family = resolve_model(hyper.model, data_config)
    if family not in WIDE_FAMILIES:
        raise ConfigError(
            f"--wide-prior {hyper.wide_prior} with MODEL={family}: the prior pulls the per-key wide weight, "
            f"which only {', '.join(sorted(WIDE_FAMILIES))} have"
        )
    if not hyper.l2_wide:
        raise ConfigError(f"--wide-prior {hyper.wide_prior} with --l2-wide 0: the prior is a strength of that L2")


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
    resolve_epochs(hyper.epochs, data_config)  # refuses EPOCHS > 1 with admission before Paddle starts
    check_wide_prior(hyper, data_config)
    resolve_window_hours(hyper, data_config)
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
