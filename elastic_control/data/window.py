"""Is there anything to train on? The data window's complete hours, checked before anything starts.

An offline run (ONLINE unset or 0) over a window without a single complete
hour trains nothing: every hour is skipped with a warning and the job ends
with no pass. ``check_data_window`` turns that into one clear error, with the
command that makes data. Online runs wait for hours to arrive, so an empty
window is fine for them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from ctr_foundation.errors import ConfigError
from elastic_control.config.data_config import DataConfig, format_hour
from elastic_control.data.readers import HOUR_DONEFILE, HourlyData


@dataclass(frozen=True)
class WindowCheck:
    hours: int  # hours in START_DATE_HR..END_DATE_HR
    first_complete: dt.datetime | None  # the first hour whose donefile exists (None: online and none yet)
    checked: int  # hours looked at until the first complete one
    online: bool


def make_data_hint(config: DataConfig) -> str:
    """The command that writes synthetic hours for exactly this window."""
    hours = sum(1 for _ in config.hours())
    minutes = f" --minutes {config.pass_minutes}" if config.pass_minutes else ""
    return (
        f"`elastic-control data synth --output {config.dataset_root} --start {format_hour(config.start)} "
        f"--hours {hours}{minutes}` (or `elastic-control data criteo --input FILE --output {config.dataset_root} "
        f"--start {format_hour(config.start)} --hours {hours}{minutes}` for real Criteo lines)"
    )


def check_data_window(config: DataConfig) -> WindowCheck:
    """At least one complete hour between START_DATE_HR and END_DATE_HR, unless ONLINE=1; else ConfigError.

    Stops at the first complete hour, so a long window on a remote store costs
    one existence check per missing hour before it.
    """
    hours = list(config.slots())
    window = f"{config.format_slot(config.start)}..{config.format_slot(config.end)}"
    try:
        data = HourlyData(config)
        for checked, hour in enumerate(hours, start=1):
            if data.is_ready(hour):
                return WindowCheck(len(hours), hour, checked, config.online)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any filesystem failure means the same to the user
        raise ConfigError(
            f"cannot look for the hours of {window} under DATASET_PATH {config.dataset_root}: {e}", path=config.source
        ) from e
    if config.online:
        return WindowCheck(len(hours), None, len(hours), True)
    unit, folder = ("slot", "YYYYMMDD/HHMM") if config.pass_minutes else ("hour", "YYYYMMDD/HH")
    raise ConfigError(
        f"no complete {unit} in {window} under DATASET_PATH {config.dataset_root} (an {unit} is complete once "
        f"{config.dataset_root.rstrip('/')}/{folder}/{HOUR_DONEFILE} exists; none of the {len(hours)} "
        f"{unit}(s) has one), so training would write no pass. Make data with {make_data_hint(config)}, "
        "point DATASET_PATH at your click logs, or set ONLINE=1 to wait for hours to arrive",
        path=config.source,
    )
