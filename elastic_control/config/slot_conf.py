"""slot.conf: one slot id per line; blank lines and ``#`` comments ignored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ctr_foundation.errors import ConfigError


@dataclass(frozen=True)
class SlotConf:
    slots: tuple[int, ...]
    source: str = "slot.conf"

    def index_of(self) -> dict[int, int]:
        """slot id -> position in the concatenated embedding."""
        return {s: i for i, s in enumerate(self.slots)}

    def to_text(self) -> str:
        return "".join(f"{s}\n" for s in self.slots)


def parse_slot_conf(text: str, source: str = "slot.conf") -> SlotConf:
    slots: list[int] = []
    seen: dict[int, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            slot = int(line)
        except ValueError:
            raise ConfigError(
                f"slot id {line!r} is not an integer (one non-negative integer per line)", path=source, line=lineno
            ) from None
        if slot < 0:
            raise ConfigError(f"slot id {slot} is negative (slot ids are integers >= 0)", path=source, line=lineno)
        if slot in seen:
            raise ConfigError(f"slot {slot} is listed twice (first on line {seen[slot]})", path=source, line=lineno)
        seen[slot] = lineno
        slots.append(slot)
    if not slots:
        raise ConfigError("no slots listed (expected one slot id per line)", path=source)
    return SlotConf(tuple(slots), source)


def load_slot_conf(path: str | Path) -> SlotConf:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found (pass the slot list with -s/--slot_conf)", path=str(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e}", path=str(path)) from e
    return parse_slot_conf(text, str(path))
