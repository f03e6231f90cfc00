"""The maintenance window: a cron expression for its start, a duration, a time zone.

APScheduler's CronTrigger computes the fire times (DST-aware), so "is now in a window" is "did a window start
within the last ``duration`` seconds". The clock is passed in, never read here, so tests can stand anywhere in
time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from apscheduler.triggers.cron import CronTrigger

# Crontab numbers days of the week from Sunday = 0 (and 7); APScheduler 3.x from Monday = 0. Names mean the same
# in both, so numbers are translated to names before the expression reaches APScheduler.
_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_NUMBER = re.compile(r"(?<![/\d])\d+")


def _day_of_week(field: str) -> str:
    def name(match: re.Match[str]) -> str:
        number = int(match.group())
        if number > 7:
            raise ValueError(f"day of week {number} is out of range 0-7")
        return _DAY_NAMES[number % 7]

    return _NUMBER.sub(name, field)


def cron_trigger(expression: str, timezone: str) -> CronTrigger:
    """A CronTrigger from a standard 5-field crontab expression (day-of-week numbers as crontab means them)."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(f"cron expression {expression!r} needs 5 fields (minute hour day month day-of-week)")
    minute, hour, day, month, day_of_week = fields
    return CronTrigger(minute=minute, hour=hour, day=day, month=month, day_of_week=_day_of_week(day_of_week),
                       timezone=ZoneInfo(timezone))


@dataclass(frozen=True)
class MaintenanceWindow:
    cron: str
    duration_seconds: float
    timezone: str = "UTC"
    _trigger: CronTrigger = field(init=False, repr=False, compare=False)  # built from the fields above

    def __post_init__(self) -> None:
        object.__setattr__(self, "_trigger", cron_trigger(self.cron, self.timezone))

    @property
    def duration(self) -> timedelta:
        return timedelta(seconds=self.duration_seconds)

    def current_start(self, now: datetime) -> datetime | None:
        """The start of the window ``now`` is in, or None when outside every window."""
        start: datetime | None = self._trigger.get_next_fire_time(None, _aware(now) - self.duration)
        if start is not None and start <= _aware(now) < start + self.duration:
            return start
        return None

    def contains(self, now: datetime) -> bool:
        return self.current_start(now) is not None

    def next_start(self, now: datetime) -> datetime | None:
        """The start of the next window strictly after ``now`` (None if the expression never fires again)."""
        start: datetime | None = self._trigger.get_next_fire_time(None, _aware(now) + timedelta(seconds=1))
        return start


def _aware(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise ValueError("maintenance times must be timezone-aware")
    return moment
