"""slot.conf: one slot id per line; blank lines and ``#`` comments ignored.

``SLOT`` is a sparse slot (its features are keys of the sparse table); ``SLOT dense`` a dense slot (one
number per line, fed to the dense part: ctr_foundation/dense_features.py). At least one sparse slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ctr_foundation.errors import ConfigError


@dataclass(frozen=True)
class SlotConf:
    slots: tuple[int, ...]  # the sparse slots, in file order
    source: str = "slot.conf"
    dense: tuple[int, ...] = ()  # the dense slots, in file order

    def index_of(self) -> dict[int, int]:
        """slot id -> position in the concatenated embedding."""
        return {s: i for i, s in enumerate(self.slots)}

    def to_text(self) -> str:
        return "".join(f"{s}\n" for s in self.slots) + "".join(f"{s} {DENSE_KIND}\n" for s in self.dense)


DENSE_KIND = "dense"


def parse_slot_conf(text: str, source: str = "slot.conf") -> SlotConf:
    slots: list[int] = []
    dense: list[int] = []
    seen: dict[int, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if len(words) > 2 or (len(words) == 2 and words[1] != DENSE_KIND):
            raise ConfigError(
                f"{line!r} is not 'SLOT' or 'SLOT {DENSE_KIND}' (one slot id per line)", path=source, line=lineno
            )
        try:
            slot = int(words[0])
        except ValueError:
            raise ConfigError(
                f"slot id {words[0]!r} is not an integer (one non-negative integer per line)", path=source, line=lineno
            ) from None
        if slot < 0:
            raise ConfigError(f"slot id {slot} is negative (slot ids are integers >= 0)", path=source, line=lineno)
        if slot in seen:
            raise ConfigError(f"slot {slot} is listed twice (first on line {seen[slot]})", path=source, line=lineno)
        seen[slot] = lineno
        (dense if len(words) == 2 else slots).append(slot)
    if not slots:
        what = "no sparse slot listed (dense slots need at least one)" if dense else "no slots listed"
        raise ConfigError(f"{what} (expected one slot id per line)", path=source)
    return SlotConf(tuple(slots), source, tuple(dense))


def load_slot_conf(path: str | Path) -> SlotConf:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found (pass the slot list with -s/--slot_conf)", path=str(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e}", path=str(path)) from e
    return parse_slot_conf(text, str(path))
