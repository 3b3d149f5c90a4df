"""``tune --apply``: the winner's settings into the plan, so that ``elastic-control -a`` trains with them.

Two places, each read by what starts the trainers:
- ``plan.extra["training_args"]``: the winner's training flags (only the settings it searched; the
  product's defaults stay in charge of the rest), appended to every training role's command line;
- the plan's data.config copy (STATE/data.config): ``PASS_HOURS``, a data.config key.
``plan.extra["tuned"]`` names the leaderboard and pass they came from. Running ``-r`` again renders a
new plan without them: apply again afterwards.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, PLAN_FILE
from elastic_control.config.data_config import load_data_config
from elastic_control.plan import TRAINING_ARGS_KEY, load_plan
from elastic_control.training.cli import hyperparameter_args
from elastic_control.tuning.leaderboard import LEADERBOARD_FILE
from elastic_control.tuning.space import hyperparameters
from elastic_control.tuning.split import config_text


def read_best(output: Path) -> dict:
    path = Path(output) / LEADERBOARD_FILE
    try:
        board = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"no {path}: run `elastic-control tune -f DATA_CONFIG -s SLOT_CONF --output {output}` first"
        ) from None
    except ValueError as e:
        raise UsageError(f"{path} is unreadable ({e}); run tune again with the same --output") from e
    if not board.get("best"):
        raise UsageError(f"{path} has no finished candidate to apply (every candidate failed or was pruned)")
    return board["best"]


def training_args(settings: dict) -> list[str]:
    """The role flags of a candidate's searched settings (epochs auto: the early stop decides)."""
    wanted = {f"--{k.replace('_', '-')}" for k in settings} | {"--epochs"}
    args, full = [], hyperparameter_args(hyperparameters(settings))
    i = 0
    while i < len(full):
        takes_value = i + 1 < len(full) and not full[i + 1].startswith("--")
        pair = full[i : i + 2] if takes_value else full[i : i + 1]
        if pair[0] in wanted:
            args += pair
        i += len(pair)
    return args


def apply_best(*, output: Path, state_dir: str) -> dict:
    """Write the winner into the plan of ``state_dir``; returns what changed."""
    best = read_best(output)
    plan = load_plan(state_dir)
    args = training_args(best["settings"])
    pass_hours = int(best["settings"].get("pass_hours", 1))
    extra = {
        **plan.extra,
        TRAINING_ARGS_KEY: args,
        "tuned": {"leaderboard": str((Path(output) / LEADERBOARD_FILE).resolve()), "pass": best["pass"]},
    }
    state = Path(state_dir)
    config = load_data_config(state / DATA_CONFIG_FILE)
    values = {**config.values, "PASS_HOURS": str(pass_hours)}
    atomic_write_text(state / DATA_CONFIG_FILE, config_text(values))
    updated = dataclasses.replace(plan, extra=extra)
    atomic_write_text(state / PLAN_FILE, json.dumps(updated.to_json(), indent=2, sort_keys=True) + "\n")
    return {"training_args": args, "pass_hours": pass_hours, "pass": best["pass"], "plan": str(state / PLAN_FILE)}
