"""Predictions for a file of slot-format lines, line by line: a bad line fails only itself.

Each non-blank line is checked here first (the slot format, through ``ctr_foundation.sample``, its one
owner; and, when the slots are known, that every slot is one of them), then the good lines go to
serving in batches. Serving refuses a whole request when one of its instances is bad, so a refused
batch is split in halves and sent again until the refused line stands alone: its error is serving's
own reason, every other line still gets its probability. Lines are numbered as in the input (1-based,
blank lines counted), whatever the batches.

A slot that is not in slot.conf would be ignored by serving (lines follow training, which ignores
such features), so a line using one is refused naming the slot, unless the caller asks for a warning
instead (``unknown_slots="warn"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from client.api import BatchRefused, ClientSettings, PredictionError, ServingClient
from ctr_foundation.errors import ComponentError, ElasticControlError, UsageError
from ctr_foundation.sample import MalformedLine, parse_sample_line
from elastic_control.config import load_slot_conf

UNKNOWN_SLOT_CHOICES = ("refuse", "warn")
EXIT_REFUSED_LINES = 3  # some lines were refused; every other line got its probability


class RefusedLines(ElasticControlError):
    """Some input lines were refused (each one's error was reported); the others were predicted."""

    exit_code = EXIT_REFUSED_LINES


@dataclass(frozen=True)
class KnownSlots:
    """The slots a line may use (sparse and dense) and where that list comes from, for messages."""

    slots: frozenset[int]
    source: str

    def unknown(self, used: Iterable[int]) -> list[int]:
        return sorted({s for s in used if s not in self.slots})

    def describe(self) -> str:
        ordered = sorted(self.slots)
        shown = ", ".join(map(str, ordered[:12])) + (", ..." if len(ordered) > 12 else "")
        return f"{self.source}: slots {shown}"


@dataclass(frozen=True)
class LineResult:
    """One input line's outcome: its probability (with the request it was answered in), or its error."""

    line: int  # 1-based number in the input
    probability: float | None = None
    error: str | None = None
    warning: str | None = None
    request_id: str | None = None  # with ``index``: what click feedback refers to
    index: int | None = None
    model_version: str | None = None
    arm: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


def slots_from_slot_conf(path: str | Path) -> KnownSlots:
    conf = load_slot_conf(path)
    return KnownSlots(frozenset(conf.slots) | frozenset(conf.dense), f"slot.conf {path}")


def known_slots(settings: ClientSettings, *, slot_conf: str | None = None) -> KnownSlots | None:
    """The slots lines may use: ``slot_conf`` when given; else the slots of the model serving answers
    with (its /v1/status); else the slot.conf `elastic-control -c` saved; None when none is known."""
    if slot_conf:
        return slots_from_slot_conf(slot_conf)
    if settings.serving_url:
        try:
            status = ServingClient(settings.serving_url, timeout=10).status()
        except (ComponentError, UsageError):
            status = {}
        if status.get("slots"):
            used = [*status["slots"], *(status.get("dense_slots") or ())]
            source = f"the model serving answers with ({status.get('model_version')})"
            return KnownSlots(frozenset(int(s) for s in used), source)
    if settings.slot_conf and Path(settings.slot_conf).is_file():
        return slots_from_slot_conf(settings.slot_conf)
    if settings.slots:  # an older client.json: the sparse slots only, without the file
        return KnownSlots(frozenset(settings.slots), "client.json")
    return None


def line_problem(text: str, slots: KnownSlots | None, unknown_slots: str = "refuse") -> tuple[str | None, str | None]:
    """(error, warning) of one non-blank line before it is sent."""
    try:
        sample = parse_sample_line(text)
    except MalformedLine as e:
        return str(e), None
    if slots is None:
        return None, None
    # Feasigns only: a value token of a slot the model does not use is ignored, as training ignores it
    # (lines converted with dense slots stay valid for a model trained on the sparse slots alone).
    unknown = slots.unknown(sample.slots)
    if not unknown:
        return None, None
    which = f"slot {unknown[0]} is" if len(unknown) == 1 else f"slots {', '.join(map(str, unknown))} are"
    their = "its" if len(unknown) == 1 else "their"
    message = f"{which} not in {slots.describe()}; serving would ignore {their} features"
    if unknown_slots == "warn":
        return None, message
    return f"{message} (pass --unknown-slots warn to score such lines anyway)", None


def predict_file_lines(
    client,
    lines: Iterable[str],
    *,
    batch_size: int = 64,
    slots: KnownSlots | None = None,
    unknown_slots: str = "refuse",
    first_line_number: int = 1,
    check_lines: bool = True,
) -> Iterator[LineResult]:
    """One LineResult per non-blank line of ``lines``, in order. ``client``: a ServingClient or
    GrpcServingClient. Raises PredictionError only when serving stays unavailable (no line is lost:
    every line before the batch that could not be sent was yielded). Without ``check_lines`` lines go
    to serving unchecked (its refusals still name the line)."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
    if unknown_slots not in UNKNOWN_SLOT_CHOICES:
        raise UsageError(f"--unknown-slots {unknown_slots!r}: use {' or '.join(UNKNOWN_SLOT_CHOICES)}")
    queue: list[LineResult | tuple[int, str, str | None]] = []  # decided results and lines to send, in order
    for number, raw in enumerate(lines, start=first_line_number):
        text = raw.strip()
        if not text:
            continue
        error, warning = line_problem(text, slots, unknown_slots) if check_lines else (None, None)
        queue.append(LineResult(number, error=error) if error else (number, text, warning))
        if len(queue) >= batch_size:
            yield from _send(client, queue)
            queue = []
    if queue:
        yield from _send(client, queue)


def _send(client, queue: list) -> Iterator[LineResult]:
    pending = [item for item in queue if not isinstance(item, LineResult)]
    scored = _score(client, pending) if pending else {}
    for item in queue:
        yield item if isinstance(item, LineResult) else scored[item[0]]


def _score(client, items: list[tuple[int, str, str | None]]) -> dict[int, LineResult]:
    """{line number: result} of lines serving is asked about; a refused batch is split until each refused
    line stands alone."""
    try:
        answer = client.predict_instances([{"line": text} for _, text, _ in items])
    except BatchRefused as e:
        if len(items) == 1:
            return {items[0][0]: LineResult(items[0][0], error=_own_reason(e.reason))}
        middle = len(items) // 2
        return {**_score(client, items[:middle]), **_score(client, items[middle:])}
    except PredictionError as e:
        first, last = items[0][0], items[-1][0]
        raise PredictionError(f"batch starting at input line {first}: {e} (lines {first}-{last} unanswered)") from e
    return {
        number: LineResult(
            number,
            probability=float(p),
            warning=warning,
            request_id=answer.get("request_id") or None,
            index=i,
            model_version=answer.get("model_version") or None,
            arm=answer.get("arm") or None,
        )
        for i, ((number, _, warning), p) in enumerate(zip(items, answer["predictions"], strict=True))
    }


def _own_reason(reason: str) -> str:
    """Serving's reason for a one-line request, without its "instance 0: " (the line number says which)."""
    prefix = "instance 0: "
    return reason[len(prefix) :] if reason.startswith(prefix) else reason
