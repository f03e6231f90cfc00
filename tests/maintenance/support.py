"""Restartable replica doubles (from tests.doubles) and controllable clocks."""

from __future__ import annotations

from datetime import datetime, timedelta

from tests.doubles import restartable_fleet

fleet = restartable_fleet


class Clock:
    """Wall time (aware datetime) and a monotonic reading that move together, by hand."""

    def __init__(self, start: datetime) -> None:
        self.wall = start
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds

    def set(self, moment: datetime) -> None:
        self.mono += (moment - self.wall).total_seconds()
        self.wall = moment
