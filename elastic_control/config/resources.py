"""Resource flags (-u -m -t -p -b) and their accepted ranges."""

from __future__ import annotations

from dataclasses import dataclass

from ctr_foundation.errors import UsageError

# Ranges that make sense for real clusters. The original script refused -m
# above 4 GiB while its own documented example used -m 20.
RANGES = {
    "cpu": (1, 256, "-u/--cpu", "CPU cores per trainer/pserver pod"),
    "mem": (1, 1024, "-m/--mem", "GiB of memory per trainer/pserver pod"),
    "trainers": (1, 512, "-t/--trainer", "trainers"),
    "pservers": (1, 256, "-p/--pserver", "parameter servers"),
    "cube_shards": (1, 256, "-b/--cube", "cube shards"),
}


@dataclass(frozen=True)
class Resources:
    cpu: int = 2
    mem: int = 4
    trainers: int = 2
    pservers: int = 2
    cube_shards: int = 2

    def __post_init__(self):
        for name, (lo, hi, flag, what) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{flag} must be an integer number of {what}, got {value!r}")
            if not lo <= value <= hi:
                raise UsageError(f"{flag} {value} is out of range: {what} must be between {lo} and {hi}")
