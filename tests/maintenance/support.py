"""Restartable replica doubles (from tests.doubles), controllable clocks, and a hung replica as the app's own
progress monitor sees one."""

from __future__ import annotations

import time
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


def judge_hung(client, *names: str) -> None:
    """Make the app's own progress monitor find ``names`` hung the way it does in production: engine readings
    (recorded through the router, as its load poller does) with requests running and a generation counter that
    stands still for the whole hung period."""
    from appliance.engine.load import EngineLoad

    router = client.app.state.router
    progress = client.app.state.maintenance.progress
    now = time.monotonic()
    for at in (now - progress.hung_after_seconds, now):
        for name in names:
            router.update_load(name, EngineLoad(running=1, generation_tokens_total=7, read_at=at))
        progress.check(at)
    assert set(names) <= set(progress.hung())
