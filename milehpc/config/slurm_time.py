"""Slurm time strings, as ``sbatch --time`` takes them, parsed to seconds (login-safe, stdlib only).

sbatch accepts "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours", "days-hours:minutes",
"days-hours:minutes:seconds" and "UNLIMITED"/"INFINITE"; fields are not range-checked ("0:75" is 75 seconds, and
"100:00:00" is 100 hours: Slurm's ``time_str2secs`` normalises). TOML reads an unquoted ``02:00:00`` as a
``datetime.time``, and ``120`` as an integer: :func:`coerce` turns both into the string Slurm would read.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

# Digit runs are bounded so that a value stays a plausible time (and its seconds fit any integer Slurm keeps).
_D = r"\d{1,7}"
TIME = rf"{_D}-{_D}(:{_D}){{0,2}}|{_D}(:{_D}){{0,2}}|UNLIMITED|INFINITE"
TIME_EXPECT = ("a Slurm time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, "
               "days-hours:minutes:seconds (quoted: \"02:00:00\"), or UNLIMITED")


DEFAULT = "01:00:00"  # a job that does not say its wall time


def job_time(asked: str | None, limit: str) -> str:
    """The ``--time`` of a job: what it asked for, else :data:`DEFAULT` capped at the partition's ``limit``."""
    if asked is not None:
        return asked
    cap = seconds(limit)
    return limit if cap is not None and cap < seconds(DEFAULT) else DEFAULT  # type: ignore[operator]


def coerce(value: Any) -> Any:
    """A TOML ``datetime.time`` (unquoted ``02:00:00``) or an integer (minutes) as the string Slurm reads; any other
    value unchanged (the field's type check reports it)."""
    if isinstance(value, datetime.time):
        if value.microsecond or value.tzinfo is not None:
            return value.isoformat()  # not a Slurm time: the pattern refuses it, showing what TOML read
        return f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    return value


def seconds(text: str) -> int | None:
    """Seconds of a Slurm time string matching :data:`TIME`; None for UNLIMITED/INFINITE."""
    if text in ("UNLIMITED", "INFINITE"):
        return None
    if not re.fullmatch(TIME, text):
        raise ValueError(f"not a Slurm time: {text!r}")
    days, dash, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if dash:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if len(parts) == 1:  # minutes
        return parts[0] * 60
    if len(parts) == 2:  # minutes:seconds
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def describe(secs: int | None) -> str:
    """Seconds as days-hours:minutes:seconds (or UNLIMITED), for messages."""
    if secs is None:
        return "UNLIMITED"
    days, rest = divmod(secs, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text
