"""`elastic-control train` (a whole local job) and the hidden `elastic-control role` (one role from the environment).

`train` runs the job under the local supervisor (elastic_control/local/train_job.py), the same machine
`elastic-control -a` uses for the pipeline.
"""

from __future__ import annotations

import functools

import click

from elastic_control.training.settings import Hyperparameters

_DEFAULTS = Hyperparameters()


def hyperparameter_options(fn):
    """Options shared by `train` and `role`, turned into a Hyperparameters object."""
    options = [
        click.option(
            "--embedding-dim",
            type=click.IntRange(2, 512),
            default=_DEFAULTS.embedding_dim,
            show_default=True,
            help="Embedding dimension per slot.",
        ),
        click.option(
            "--batch-size", type=click.IntRange(1, 1_000_000), default=_DEFAULTS.batch_size, show_default=True
        ),
        click.option(
            "--learning-rate",
            type=click.FloatRange(0, 10, min_open=True),
            default=_DEFAULTS.learning_rate,
            show_default=True,
        ),
        click.option(
            "--sparse-learning-rate",
            type=click.FloatRange(0, 10, min_open=True),
            default=_DEFAULTS.sparse_learning_rate,
            show_default=True,
            help="Learning rate of the embeddings (sparse Adam rule).",
        ),
        click.option(
            "--log-every",
            type=click.IntRange(1),
            default=_DEFAULTS.log_every,
            show_default=True,
            help="Steps between progress lines and MLflow step metrics.",
        ),
        click.option(
            "--golden-lines",
            type=click.IntRange(0, 100_000),
            default=_DEFAULTS.golden_lines,
            show_default=True,
            help="Held-out lines per pass scored into golden.jsonl.",
        ),
        click.option(
            "--dense-pull-every",
            type=click.IntRange(1),
            default=_DEFAULTS.dense_pull_every,
            show_default=True,
            help="Steps between pulls of the dense parameters from the pservers.",
        ),
        click.option(
            "--wait-timeout",
            type=click.FloatRange(0),
            default=None,
            help="ONLINE=1: fail after waiting this many seconds for an hour (default: wait forever).",
        ),
        click.option(
            "--poll-seconds",
            type=click.FloatRange(0.01),
            default=_DEFAULTS.poll_seconds,
            show_default=True,
            help="ONLINE=1: how often to look for an hour's donefile.",
        ),
    ]

    @functools.wraps(fn)
    def wrapper(
        *args,
        embedding_dim,
        batch_size,
        learning_rate,
        sparse_learning_rate,
        log_every,
        golden_lines,
        dense_pull_every,
        wait_timeout,
        poll_seconds,
        **kwargs,
    ):
        hyper = Hyperparameters(
            embedding_dim=embedding_dim,
            batch_size=batch_size,
            learning_rate=learning_rate,
            sparse_learning_rate=sparse_learning_rate,
            log_every=log_every,
            golden_lines=golden_lines,
            dense_pull_every=dense_pull_every,
            wait_timeout=wait_timeout,
            poll_seconds=poll_seconds,
        )
        return fn(*args, hyper=hyper, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def hyperparameter_args(hyper: Hyperparameters) -> list[str]:
    """The same settings as `role` flags, for the role processes `train` starts."""
    args = [
        "--embedding-dim",
        str(hyper.embedding_dim),
        "--batch-size",
        str(hyper.batch_size),
        "--learning-rate",
        repr(hyper.learning_rate),
        "--sparse-learning-rate",
        repr(hyper.sparse_learning_rate),
        "--log-every",
        str(hyper.log_every),
        "--golden-lines",
        str(hyper.golden_lines),
        "--poll-seconds",
        repr(hyper.poll_seconds),
        "--dense-pull-every",
        str(hyper.dense_pull_every),
    ]
    if hyper.wait_timeout is not None:
        args += ["--wait-timeout", repr(hyper.wait_timeout)]
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
    from ctr_foundation.env_vars import MODEL_PATH
    from ctr_foundation.errors import ConfigError
    from elastic_control.config.data_config import load_data_config
    from elastic_control.config.slot_conf import load_slot_conf
    from elastic_control.console import console, done, out
    from elastic_control.data.window import check_data_window
    from elastic_control.local.components import training_window
    from elastic_control.local.train_job import run_training_job

    config = load_data_config(datafile)
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
    from ctr_foundation.errors import ConfigError, DataError
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
@hyperparameter_options
def role_command(hyper, check_window):
    from elastic_control.training.settings import role_settings_from_env

    settings = role_settings_from_env(hyper)
    if check_window and settings.role == "TRAINER":
        check_window_in_pod(settings.data_config)
    if settings.role == "PSERVER":
        from elastic_control.training.pserver import run_pserver

        run_pserver(settings)
    else:
        from elastic_control.training.trainer import run_trainer

        run_trainer(settings)
