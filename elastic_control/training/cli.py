"""`elastic-control train` (a whole local job) and the hidden `elastic-control role` (one role from the environment).

`train` runs the job under the local supervisor (elastic_control/local/train_job.py), the same machine
`elastic-control -a` uses for the pipeline.
"""

from __future__ import annotations

import functools
import socket

import click

from ctr_foundation import env_vars as ev
from ctr_foundation.env_vars import MODEL_PATH
from ctr_foundation.errors import ConfigError, DataError
from ctr_foundation.log_keeper import keep_logs
from elastic_control.config.data_config import load_data_config, parse_epochs
from elastic_control.config.slot_conf import load_slot_conf
from elastic_control.console import console, done, out
from elastic_control.training.families import FAMILIES
from elastic_control.training.model import SPARSE_RULES
from elastic_control.training.pserver import run_pserver
from elastic_control.training.settings import (
    DEFAULT_EPOCHS,
    DEFAULT_MODEL,
    Hyperparameters,
    check_wide_prior,
    resolve_epochs,
    resolve_window_hours,
    role_settings_from_env,
)

_DEFAULTS = Hyperparameters()


class _Hidden(click.ParamType):
    """``400,400,400`` -> (400, 400, 400); ``none`` or empty -> () (no MLP)."""

    name = "WIDTHS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower()
        if text in ("", "none", "0"):
            return ()
        try:
            widths = tuple(int(v) for v in text.split(","))
            if any(not 1 <= w <= 100_000 for w in widths):
                raise ValueError
        except ValueError:
            self.fail(
                f"{value!r} is not a comma-separated list of layer widths (e.g. 400,400,400) or 'none'", param, ctx
            )
        return widths


class _Epochs(click.ParamType):
    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        try:
            return parse_epochs(str(value), key="--epochs")
        except ConfigError as e:
            self.fail(str(e), param, ctx)


_RULES = click.Choice(list(SPARSE_RULES))
_RATE = click.FloatRange(0, 10, min_open=True)

# (flag, Hyperparameters field, click type, help); every one is also a `role` flag (hyperparameter_args).
_OPTIONS = [
    (
        "--model",
        "model",
        click.Choice(FAMILIES),
        f"Model family (default: MODEL of data.config, else {DEFAULT_MODEL}).",
    ),
    (
        "--epochs",
        "epochs",
        _Epochs(),
        f"Epochs per pass, or auto (default: EPOCHS of data.config, else {DEFAULT_EPOCHS}).",
    ),
    (
        "--min-steps-per-pass",
        "min_steps_per_pass",
        click.IntRange(1),
        "EPOCHS=auto: the whole number of epochs nearest this many steps per trainer.",
    ),
    (
        "--min-steps-first-pass",
        "min_steps_first_pass",
        click.IntRange(1),
        "EPOCHS=auto: at least this many steps in the first pass of a model not resumed.",
    ),
    ("--max-epochs", "max_epochs", click.IntRange(1, 1000), "EPOCHS=auto: at most this many epochs per pass."),
    (
        "--early-stop/--no-early-stop",
        "early_stop",
        None,
        "Stop a pass's epochs when held-out log loss rises (default: EARLY_STOP, else on).",
    ),
    (
        "--restore-best-epoch/--no-restore-best-epoch",
        "restore_best_epoch",
        None,
        "With the early stop, export the pass's best epoch, not the worse one that stopped it (default: on).",
    ),
    (
        "--refit-bias/--no-refit-bias",
        "refit_bias",
        None,
        "After each pass, move the logit bias so that the mean prediction on the pass's lines is their click "
        "rate (default: on).",
    ),
    (
        "--early-stop-patience",
        "early_stop_patience",
        click.IntRange(1, 100),
        "With --restore-best-epoch: epochs after the best that end a pass, each counted 1 when worse beyond "
        "the held-out noise (2 standard errors), 0.5 within it.",
    ),
    (
        "--min-holdout-to-stop",
        "min_holdout_to_stop",
        click.IntRange(0),
        "EPOCHS=auto with the early stop: a pass with fewer held-out lines is not judged by them but "
        "trains at most --unjudged-pass-epochs epochs (0: every pass is judged).",
    ),
    (
        "--unjudged-pass-epochs",
        "unjudged_pass_epochs",
        click.IntRange(1, 1000),
        "EPOCHS=auto: the most epochs of a pass with too few held-out lines to stop early.",
    ),
    (
        "--window-hours",
        "window_hours",
        click.IntRange(1, 168),
        "Each hourly pass also trains one epoch over the lines of the N-1 hours before it (default: 1, one "
        "hour a pass; more only without PASS_HOURS, PASS_MINUTES and ADMIT_MIN_COUNT).",
    ),
    ("--embedding-dim", "embedding_dim", click.IntRange(2, 512), "Cube row width per key: embed_w + embedx_w."),
    ("--hidden", "hidden", _Hidden(), "MLP layer widths, e.g. 400,400,400 ('none': no MLP)."),
    (
        "--batch-size",
        "batch_size",
        click.IntRange(1, 1_000_000),
        "Lines per step (a small first pass trains fewer: --min-batches-first-pass).",
    ),
    (
        "--min-batches-first-pass",
        "min_batches_first_pass",
        click.IntRange(0),
        "The first pass of a fresh model: a trainer's share with fewer batches than this trains smaller "
        "ones (share / this, at least 16 lines; 0: off).",
    ),
    ("--learning-rate", "learning_rate", _RATE, "Dense part (Adam on the pservers)."),
    ("--sparse-learning-rate", "sparse_learning_rate", _RATE, "embedx_w, the embeddings (sparse rule)."),
    ("--wide-learning-rate", "wide_learning_rate", _RATE, "embed_w, the wide weight of the wide families."),
    ("--sparse-optimizer", "sparse_optimizer", _RULES, "Sparse rule of embedx_w (decay: per-key rate decay)."),
    ("--wide-optimizer", "wide_optimizer", _RULES, "Sparse rule of embed_w (decay: per-key rate decay)."),
    (
        "--decay-sightings",
        "decay_sightings",
        click.FloatRange(min=0, min_open=True),
        "decay rule: a key's rate is rate / sqrt(1 + sightings / this) (default: 3000; deepfm 30).",
    ),
    ("--l2-embedding", "l2_embedding", click.FloatRange(0), "L2 per key occurrence on embedx_w."),
    ("--l2-wide", "l2_wide", click.FloatRange(0), "L2 per key occurrence on embed_w."),
    (
        "--wide-prior",
        "wide_prior",
        click.FloatRange(0),
        "Later passes pull embed_w toward its pass-start value with --l2-wide + this per earlier occurrence "
        "(0: toward 0; default: 0.095 for the wide families with --l2-wide > 0, else off).",
    ),
    ("--dense-l2", "dense_l2", click.FloatRange(0), "Weight decay of the dense weights."),
    ("--cross-layers", "cross_layers", click.IntRange(1, 16), "dcn: cross layers."),
    ("--cross-rank", "cross_rank", click.IntRange(1, 4096), "dcn: rank of each cross layer."),
    (
        "--shuffle-lines",
        "shuffle_lines",
        click.IntRange(0),
        "Shuffle lines within windows of this many (0: file order).",
    ),
    ("--holdout-lines", "holdout_lines", click.IntRange(0, 1_000_000), "Trainer 0's held-out lines per pass."),
    ("--log-every", "log_every", click.IntRange(1), "Steps between progress lines and MLflow step metrics."),
    ("--golden-lines", "golden_lines", click.IntRange(0, 100_000), "Held-out lines per pass scored into golden.jsonl."),
    ("--dense-pull-every", "dense_pull_every", click.IntRange(1), "Steps between pulls of the dense parameters."),
    ("--wait-timeout", "wait_timeout", click.FloatRange(0), "ONLINE=1: fail after waiting this long for an hour (s)."),
    ("--poll-seconds", "poll_seconds", click.FloatRange(0.01), "ONLINE=1: how often to look for an hour's donefile."),
]


def hyperparameter_options(fn):
    """Options shared by `train` and `role`, turned into a Hyperparameters object."""
    fields = [field for _, field, _, _ in _OPTIONS]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        values = {f: kwargs.pop(f) for f in fields}
        return fn(*args, hyper=Hyperparameters(**values), **kwargs)

    for flag, field, kind, help_text in reversed(_OPTIONS):
        default = getattr(_DEFAULTS, field)
        if kind is None:  # a boolean pair; None keeps "not given" apart from --no-...
            option = click.option(flag, field, default=None, help=help_text)
        else:
            option = click.option(
                flag, field, type=kind, default=default, show_default=default is not None, help=help_text
            )
        wrapper = option(wrapper)
    return wrapper


def hyperparameter_args(hyper: Hyperparameters) -> list[str]:
    """The same settings as `role` flags, for the role processes `train` starts."""
    args: list[str] = []
    for flag, field, _, _ in _OPTIONS:
        value = getattr(hyper, field)
        if value is None:
            continue
        if "/" in flag:  # a boolean pair: --x/--no-x
            on, off = flag.split("/")
            args.append(on if value else off)
        elif field == "hidden":
            args += [flag, ",".join(map(str, value)) or "none"]
        else:
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    return args


@click.command("train", help="Train locally: P pservers and T trainers as processes on loopback, passes to MODEL_PATH.")
@click.option(
    "-f", "--datafile", default="data.config", show_default=True, help="data.config: data location and window."
)
@click.option("-s", "--slot_conf", default="slot.conf", show_default=True, help="slot.conf: the slots to train on.")
@click.option("-t", "--trainer", "trainers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("-p", "--pserver", "pservers", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option(
    "--model-path", default=None, help="Where passes go (default: MODEL_PATH of the environment or data.config)."
)
@click.option("--timeout", type=click.FloatRange(0), default=None, help="Fail if training takes longer (seconds).")
@hyperparameter_options
def train_command(datafile, slot_conf, trainers, pservers, model_path, timeout, hyper):
    # function-level: keeps `elastic-control --help` fast (the data readers load fsspec, the local supervisor
    # psutil and the catalogue: ~40 ms)
    from elastic_control.data.window import check_data_window
    from elastic_control.local.components import training_window
    from elastic_control.local.train_job import run_training_job

    config = load_data_config(datafile)
    resolve_epochs(hyper.epochs, config)  # EPOCHS > 1 with ADMIT_MIN_COUNT: a usage error, before any process
    check_wide_prior(hyper, config)
    resolve_window_hours(hyper, config)
    slots = load_slot_conf(slot_conf)
    model_path = model_path or MODEL_PATH.get() or config.model_path
    if not model_path:
        raise ConfigError("no MODEL_PATH: pass --model-path, set MODEL_PATH, or add it to data.config")
    check_data_window(config)  # an offline window without a complete hour would train nothing
    console.print(
        f"training {len(slots.slots)} slots, hours {config.start:%Y%m%d/%H}..{config.end:%Y%m%d/%H} "
        f"with {trainers} trainer(s) and {pservers} pserver(s); passes -> {model_path} "
        f"(logs in {model_path}/logs)"
    )
    result = run_training_job(
        trainers=trainers,
        pservers=pservers,
        data_config=datafile,
        slot_conf=slot_conf,
        model_path=model_path,
        role_args=hyperparameter_args(hyper),
        timeout=timeout,
        on_line=lambda name, line: console.print(line, markup=False, highlight=False),
        window=training_window(config),
    )
    note = "" if result.pservers_exited_by_themselves else " (pservers had to be stopped)"
    done(f"training finished in {result.seconds:.0f}s; {len(result.passes)} complete pass(es){note}")
    if result.passes:
        out(result.passes[-1])


def check_window_in_pod(config) -> None:
    """In a pod, an offline window without a complete hour would end the job Completed with no pass:
    that is a configuration error (exit 2: the job's policy aborts it at once, the reason in trainer 0's
    log). A store that cannot be read right now is a failure (exit 1): the job restarts and tries again."""
    # function-level: keeps `elastic-control --help` fast (the data readers load fsspec, ~20 ms)
    from elastic_control.data.window import check_data_window

    try:
        check_data_window(config)
    except ConfigError as e:
        if e.__cause__ is not None and not isinstance(e.__cause__, ConfigError):
            raise DataError(str(e)) from e
        raise


@click.command(
    "role",
    hidden=True,
    help="Run one training role from the environment (TRAINING_ROLE, PADDLE_*, "
    "ELASTIC_CTR_DATA_CONFIG, ELASTIC_CTR_SLOT_CONF, MODEL_PATH).",
)
@click.option(
    "--check-window",
    is_flag=True,
    hidden=True,
    help="Trainers: first check that an offline window has a complete hour (the Kubernetes manifests pass it).",
)
@click.option(
    "--keep-logs",
    "keep_logs_dir",
    default=None,
    hidden=True,
    metavar="DIR",
    help="Keep a copy of this role's output under DIR/POD/ (the manifests pass the shared claim's logs/ folder: "
    "the log of a pod Volcano deleted is still there for -l).",
)
@hyperparameter_options
def role_command(hyper, check_window, keep_logs_dir):
    if keep_logs_dir:  # first: a configuration error below is what a kept log is for
        keep_logs(keep_logs_dir, socket.gethostname(), (ev.TRAINING_ROLE.get() or "role").lower())
    settings = role_settings_from_env(hyper)
    if check_window and settings.role == "TRAINER":
        check_window_in_pod(settings.data_config)
    if settings.role == "PSERVER":
        run_pserver(settings)
    else:
        # function-level: keeps `elastic-control --help` fast (the trainer loads the data readers and fsspec, ~30 ms)
        from elastic_control.training.trainer import run_trainer

        run_trainer(settings)
