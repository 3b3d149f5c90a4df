"""The progress of the pass being trained: trainer 0 rewrites MODEL_PATH/.progress.json while it trains.

The document (written atomically, at most about once a second, and when an epoch
starts or the pass ends)::

    {"pass", "epoch", "epochs", "steps", "steps_planned", "examples_per_sec", "eta_seconds", "updated_at"}

``steps`` counts trainer 0's steps of the pass so far (every trainer takes an equal
share); ``epochs`` and ``steps_planned`` are null until known (EPOCHS=auto plans the
epochs after the first one; the steps of an epoch are known once the first epoch ran,
or from the share's line count when the trainer counted it first); ``eta_seconds``
is null while ``steps_planned`` is. A MODEL_PATH that is a URL (hdfs://, s3://) gets
no document. Status (``training.progress``), ``-l`` (the trainers' step lines) and
the demo read it. ``sink`` (trainer 0 in a Kubernetes pod: the Volcano job's annotation,
elastic_control/training/job_progress.py) gets the same document whenever it is written.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json

PROGRESS_FILE = ".progress.json"
FIELDS = ("pass", "epoch", "epochs", "steps", "steps_planned", "examples_per_sec", "eta_seconds")
WRITE_EVERY = 1.0


def progress_path(model_path: str | None) -> Path | None:
    if not model_path or "://" in model_path:
        return None
    return Path(model_path) / PROGRESS_FILE


def read_progress(model_path: str | None) -> dict | None:
    path = progress_path(model_path)
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def describe(doc: dict) -> str:
    """One line for people: ``pass P: epoch 1/2, step 40/120, 3500 examples/s, ETA 12s``."""
    epoch = f"epoch {doc.get('epoch')}" + (f"/{doc['epochs']}" if doc.get("epochs") else "")
    steps = f"step {doc.get('steps')}" + (f"/{doc['steps_planned']}" if doc.get("steps_planned") else "")
    parts = [epoch, steps]
    if doc.get("examples_per_sec") is not None:
        parts.append(f"{doc['examples_per_sec']:.0f} examples/s")
    if doc.get("eta_seconds") is not None:
        parts.append(f"ETA {doc['eta_seconds']:.0f}s")
    return f"pass {doc.get('pass')}: " + ", ".join(parts)


class PassProgress:
    """What a trainer knows of its pass's progress; trainer 0 (``write``) publishes it under MODEL_PATH."""

    def __init__(
        self,
        model_path: str | None,
        name: str,
        *,
        write: bool,
        epochs: int | None = None,
        sink: Callable[..., None] | None = None,
    ):
        self.path = progress_path(model_path) if write else None
        self.sink = sink if write else None  # called as sink(document, force=...)
        self.name = name
        self.epoch = 1
        self.epochs = epochs
        self.steps = 0
        self.steps_per_epoch: int | None = None
        self.examples = 0
        self.started = time.monotonic()
        self._written = 0.0
        self._final: int | None = None

    def expect(self, *, share_lines: int | None = None, batch_size: int | None = None) -> None:
        """The epoch's steps estimated from the share's line count, before the first epoch ran."""
        if self.steps_per_epoch is None and share_lines and batch_size:
            self.steps_per_epoch = max(1, math.ceil(share_lines / batch_size))

    def start_epoch(self, epoch: int, epochs: int | None = None, steps_per_epoch: int | None = None) -> None:
        self.epoch = epoch
        self.epochs = epochs or self.epochs
        if steps_per_epoch:
            self.steps_per_epoch = steps_per_epoch
        self.publish(force=True)

    def step(self, steps: int, examples: int) -> None:
        """After each step: the pass's steps and examples so far (the rate is the pass's mean)."""
        self.steps, self.examples = steps, examples
        self.publish()

    def finish(self, epochs: int) -> None:
        """The pass's epochs ran (an early stop may end it before the planned ones)."""
        self.epochs, self._final = epochs, self.steps
        self.publish(force=True)

    @property
    def examples_per_sec(self) -> float | None:
        seconds = time.monotonic() - self.started
        return self.examples / seconds if self.examples and seconds > 0 else None

    @property
    def steps_planned(self) -> int | None:
        if self._final is not None:
            return self._final
        if not self.epochs or not self.steps_per_epoch:
            return None
        return max(self.epochs * self.steps_per_epoch, self.steps)

    @property
    def eta_seconds(self) -> float | None:
        planned = self.steps_planned
        if planned is None or not self.steps:
            return None
        per_step = (time.monotonic() - self.started) / self.steps
        return round(max(0, planned - self.steps) * per_step, 1)

    def document(self) -> dict:
        rate = self.examples_per_sec
        return {
            "pass": self.name,
            "epoch": self.epoch,
            "epochs": self.epochs,
            "steps": self.steps,
            "steps_planned": self.steps_planned,
            "examples_per_sec": None if rate is None else round(rate, 1),
            "eta_seconds": self.eta_seconds,
            "updated_at": time.time(),
        }

    def suffix(self) -> str:
        """What a step log line adds: `` (pass step 40/120, epoch 1/2, ETA 12s)``."""
        planned = self.steps_planned
        text = f"pass step {self.steps}" + (f"/{planned}" if planned else "")
        text += f", epoch {self.epoch}" + (f"/{self.epochs}" if self.epochs else "")
        eta = self.eta_seconds
        return f" ({text}" + (f", ETA {eta:.0f}s)" if eta is not None else ")")

    def publish(self, *, force: bool = False) -> None:
        if self.path is None and self.sink is None:
            return
        now = time.monotonic()
        if not force and now - self._written < WRITE_EVERY:
            return
        self._written = now
        doc = self.document()
        if self.path is not None:
            try:
                atomic_write_json(self.path, doc)
            except OSError:
                pass  # progress is for people: never fail a pass over it
        if self.sink is not None:
            self.sink(doc, force=force)
