"""The promotion gate as cube-transfer sees it: a callable injected into the transfer loop.

cube-transfer never imports evaluation, training, Paddle or MLflow. When a
rule is configured, the decision comes from a separate command (by default
``python -m elastic_control eval gate``) that scores the candidate on the
hold-out hours and prints one JSON decision on stdout. The child process also
keeps the evaluation's memory and any crash of Paddle out of the rollout service.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.errors import ComponentError

# The command prints {"passed": bool, "reason": str, "metrics": {...}} as its last stdout line.
DEFAULT_GATE_COMMAND = f"{shlex.quote(sys.executable)} -m elastic_control eval gate"
DEFAULT_GATE_TIMEOUT = 3600.0


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str
    metrics: dict = field(default_factory=dict)


# gate(candidate_pass_dir, active_pass_dir or None) -> GateDecision; raises ComponentError when it
# could not decide (the pass is then retried later, never promoted).
Gate = Callable[[Path, "Path | None"], GateDecision]


@dataclass(frozen=True)
class CommandGate:
    """Runs ``command --candidate C [--active A] --rule RULE --json`` and reads its decision."""

    rule: str
    command: str = DEFAULT_GATE_COMMAND
    timeout: float = DEFAULT_GATE_TIMEOUT

    def argv(self, candidate: Path, active: Path | None) -> list[str]:
        argv = [*shlex.split(self.command), "--candidate", str(candidate)]
        if active is not None:
            argv += ["--active", str(active)]
        return [*argv, "--rule", self.rule, "--json"]

    def __call__(self, candidate: Path, active: Path | None) -> GateDecision:
        argv = self.argv(candidate, active)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ComponentError(f"promotion gate command {argv[0]!r} could not run: {e}") from e
        decision = _last_json_line(proc.stdout)
        if proc.returncode != 0 or decision is None:
            tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
            raise ComponentError(f"promotion gate failed (exit {proc.returncode}): {tail}")
        try:
            return GateDecision(bool(decision["passed"]), str(decision["reason"]), dict(decision.get("metrics") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ComponentError(f"promotion gate printed an unreadable decision {decision!r}: {e}") from e


def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        return obj if isinstance(obj, dict) else None
    return None
