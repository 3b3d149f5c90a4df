"""The search space: which training settings a candidate may have, and the known good points tried first.

A candidate's settings are a flat dict: Hyperparameters field overrides (training/settings.py) plus
``pass_hours`` (PASS_HOURS of data.config). Every choice list and range is widened to hold the product's
current defaults, so the defaults are a point of the space however they change.
"""

from __future__ import annotations

import dataclasses

from elastic_control.training.families import FAMILIES
from elastic_control.training.model import SPARSE_RULES
from elastic_control.training.settings import DEFAULT_MODEL, DEFAULT_WINDOW_HOURS, Hyperparameters

HIDDEN_CHOICES = ("64,32", "128,64", "256,256", "400,400,400")
EMBEDDING_CHOICES = (5, 9, 11, 17)
L2_EMBEDDING_CHOICES = (0.0, 0.5, 2.0, 5.0)
L2_WIDE_CHOICES = (0.0, 1.0, 5.0)
MAX_EPOCHS_CHOICES = (3, 8, 15)
# --window-hours of an hourly pass (a pass over several hours has none: resolve_window_hours).
WINDOW_CHOICES = (1, 2, 4)
# EPOCHS=auto plans the epochs nearest --min-steps-per-pass steps (the default rule: an hour of Criteo
# lines trains one epoch), or with HELD_OUT_DECIDES every pass plans max_epochs and the early stop ends it
# (what data with learnable interactions and independent hours wants: docs/benchmarks.md "Model quality").
HELD_OUT_DECIDES = 100_000
# (low, high) of the log-uniform rates; widened to the defaults.
DENSE_RATE = (1e-4, 3e-3)
SPARSE_RATE = (1e-3, 0.1)
WIDE_RATE = (1e-3, 0.1)
# The deep family that learned pairwise interactions best on the measured interaction benchmark.
STRONG_DEEPFM = {
    "model": "deepfm",
    "learning_rate": 0.001,
    "sparse_optimizer": "adam",
    "wide_optimizer": "adam",
    "l2_embedding": 0.0,
    "l2_wide": 0.0,
    "embedding_dim": 11,
    "hidden": "256,256",
    "max_epochs": 15,
    "min_steps_per_pass": HELD_OUT_DECIDES,
}


def _with(choices: tuple, value) -> list:
    return sorted({*choices, value})


def _span(bounds: tuple[float, float], value: float) -> tuple[float, float]:
    return min(bounds[0], value), max(bounds[1], value)


def hidden_text(widths) -> str:
    return ",".join(str(w) for w in widths) or "none"


def pass_hours_choices(train_hours: int) -> list[int]:
    """1, 2, 4, ... hours a pass, and the whole window in one pass (the largest useful value)."""
    out, n = [], 1
    while n < train_hours:
        out.append(n)
        n *= 2
    return [*out, train_hours]


def product_defaults(train_hours: int) -> dict:
    """The defaults as a point of the space (``epochs`` stays auto, the default's own max_epochs)."""
    d = Hyperparameters()
    return {
        "model": DEFAULT_MODEL,
        "hidden": hidden_text(d.hidden),
        "embedding_dim": d.embedding_dim,
        "learning_rate": d.learning_rate,
        "sparse_learning_rate": d.sparse_learning_rate,
        "wide_learning_rate": d.wide_learning_rate,
        "sparse_optimizer": d.sparse_optimizer,
        "wide_optimizer": d.wide_optimizer,
        "l2_embedding": d.l2_embedding,
        "l2_wide": d.l2_wide,
        "max_epochs": d.max_epochs,
        "min_steps_per_pass": d.min_steps_per_pass,
        "pass_hours": 1,
        "window_hours": DEFAULT_WINDOW_HOURS,
    }


def seed_points(train_hours: int) -> list[dict]:
    """Tried first, in order: the product defaults and the strong deepfm point over the whole window."""
    defaults = product_defaults(train_hours)
    strong = {**defaults, **STRONG_DEEPFM, "pass_hours": train_hours, "window_hours": 1}
    return [defaults] if strong == defaults else [defaults, strong]


def suggest(trial, *, train_hours: int) -> dict:
    """A candidate's settings from an Optuna trial (enqueued seed points come back unchanged)."""
    base = product_defaults(train_hours)
    rules = list(SPARSE_RULES)
    return {
        "model": trial.suggest_categorical("model", list(FAMILIES)),
        "hidden": trial.suggest_categorical("hidden", _with(HIDDEN_CHOICES, base["hidden"])),
        "embedding_dim": trial.suggest_categorical("embedding_dim", _with(EMBEDDING_CHOICES, base["embedding_dim"])),
        "learning_rate": trial.suggest_float("learning_rate", *_span(DENSE_RATE, base["learning_rate"]), log=True),
        "sparse_learning_rate": trial.suggest_float(
            "sparse_learning_rate", *_span(SPARSE_RATE, base["sparse_learning_rate"]), log=True
        ),
        "wide_learning_rate": trial.suggest_float(
            "wide_learning_rate", *_span(WIDE_RATE, base["wide_learning_rate"]), log=True
        ),
        "sparse_optimizer": trial.suggest_categorical("sparse_optimizer", rules),
        "wide_optimizer": trial.suggest_categorical("wide_optimizer", rules),
        "l2_embedding": trial.suggest_categorical("l2_embedding", _with(L2_EMBEDDING_CHOICES, base["l2_embedding"])),
        "l2_wide": trial.suggest_categorical("l2_wide", _with(L2_WIDE_CHOICES, base["l2_wide"])),
        "max_epochs": trial.suggest_categorical("max_epochs", _with(MAX_EPOCHS_CHOICES, base["max_epochs"])),
        "min_steps_per_pass": trial.suggest_categorical(
            "min_steps_per_pass", _with((HELD_OUT_DECIDES,), base["min_steps_per_pass"])
        ),
        "pass_hours": (pass_hours := trial.suggest_categorical("pass_hours", pass_hours_choices(train_hours))),
        "window_hours": (
            trial.suggest_categorical("window_hours", _with(WINDOW_CHOICES, base["window_hours"]))
            if pass_hours == 1
            else 1
        ),
    }


def hyperparameters(settings: dict, *, max_epochs_cap: int | None = None) -> Hyperparameters:
    """The Hyperparameters a candidate trains with: its settings over the product defaults, epochs auto
    (the step rule, or the early stop up to max_epochs; ``max_epochs_cap`` bounds it, e.g. in tests)."""
    fields = {f.name for f in dataclasses.fields(Hyperparameters)}
    values = {k: v for k, v in settings.items() if k in fields}
    if "hidden" in values:
        text = str(values["hidden"])
        values["hidden"] = () if text == "none" else tuple(int(w) for w in text.split(","))
    if max_epochs_cap is not None:
        values["max_epochs"] = min(int(values.get("max_epochs", Hyperparameters().max_epochs)), max_epochs_cap)
    return Hyperparameters(**{**values, "epochs": "auto"})


def describe(settings: dict) -> str:
    """A short one-line summary for tables."""
    s = settings
    return (
        f"{s.get('model')} {s.get('hidden')} e{s.get('embedding_dim')} lr {s.get('learning_rate', 0):.2g} "
        f"sp {s.get('sparse_optimizer')} {s.get('sparse_learning_rate', 0):.2g} "
        f"wd {s.get('wide_optimizer')} {s.get('wide_learning_rate', 0):.2g} "
        f"l2 {s.get('l2_embedding')}/{s.get('l2_wide')} ep<={s.get('max_epochs')}"
        + (" held-out" if s.get("min_steps_per_pass") == HELD_OUT_DECIDES else "")
        + f" ph {s.get('pass_hours')}"
        + (f" w {s['window_hours']}" if s.get("window_hours", 1) > 1 else "")
    )
