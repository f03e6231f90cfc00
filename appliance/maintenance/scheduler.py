"""The maintenance job: every ``check_interval_seconds`` (APScheduler, in the gateway's event loop) it samples
traffic, forward progress and memory, and decides whether a rolling restart runs now.

A rolling restart runs only when traffic is low, and then when
- a restart is wanted (a replica's fragmentation or memory growth crossed its threshold, or a whitelisted alert
  asked for one): at the first low-traffic moment, window or not; or
- the maintenance window is open and this window has not had its rolling restart yet.
Outside the window and at peak nothing happens: a wanted restart waits, and so does one while another node holds
the fleet's restart lease (role node; appliance/maintenance/coordination.py). Memory is read every round even with
automatic restarts off: the alert webhook confirms memory alerts against the latest reading. The decision itself
(``check``) takes the time as an argument, so tests drive it with a controllable clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from appliance.maintenance.controller import MaintenanceController
from appliance.maintenance.errors import MaintenanceError
from appliance.maintenance.memory import MemoryWatch
from appliance.maintenance.progress import ProgressMonitor
from appliance.maintenance.rolling import Outcome
from appliance.maintenance.settings import MaintenanceSettings
from appliance.maintenance.traffic import TrafficSampler, TrafficVerdict
from appliance.maintenance.window import MaintenanceWindow

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


class MaintenanceScheduler:
    def __init__(self, settings: MaintenanceSettings, controller: MaintenanceController, traffic: TrafficSampler,
                 progress: ProgressMonitor, memory: MemoryWatch | None = None, *,
                 now: Callable[[], datetime] = utc_now, monotonic: Callable[[], float] = time.monotonic,
                 refresh_traffic: Callable[[], Awaitable[None]] | None = None) -> None:
        """``refresh_traffic``: awaited before each traffic sample (a node reads its engines' counters then)."""
        self.settings = settings
        self._refresh_traffic = refresh_traffic
        self.controller = controller
        self.traffic = traffic
        self.progress = progress
        self.memory = memory
        self.window = MaintenanceWindow(settings.window_cron, settings.window_duration_seconds, settings.timezone)
        self._now = now
        self._monotonic = monotonic
        self.wanted: tuple[str, str] | None = None  # (trigger, reason) of a rolling restart waiting for low traffic
        self.last_verdict: TrafficVerdict | None = None
        self.lease_wait: str | None = None  # why the fleet's restart lease is not to be had now (role node)
        self._window_done: datetime | None = None  # start of the window whose rolling restart has run
        self._memory_restart_at: float | None = None  # monotonic time of the last memory-triggered restart
        self._scheduler: AsyncIOScheduler | None = None

    # -- life cycle (the gateway's lifespan) ------------------------------------------------------------------

    def start(self) -> None:
        # APScheduler logs every run of every job at INFO: a line every check_interval_seconds says nothing.
        logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
        self._scheduler = AsyncIOScheduler(timezone=UTC)
        self._scheduler.add_job(self.check, "interval", seconds=self.settings.check_interval_seconds,
                                id="maintenance-check", max_instances=1, coalesce=True,
                                next_run_time=self._now())
        self._scheduler.start()

    def stop(self) -> None:
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._scheduler = None

    # -- decisions --------------------------------------------------------------------------------------------

    def want_rolling_restart(self, trigger: str, reason: str) -> None:
        """Run a rolling restart at the next low-traffic moment (not at peak, but without waiting for the window)."""
        if self.wanted is None:
            log.info("maintenance: rolling restart wanted (%s: %s); waiting for low traffic", trigger, reason)
            self.wanted = (trigger, reason)

    async def check(self) -> str:
        """One round; returns what it decided (for logs and tests)."""
        if self._refresh_traffic is not None:
            try:
                await self._refresh_traffic()
            except Exception:  # a failed read is a missing sample, never a dead maintenance job
                log.exception("maintenance: reading traffic failed")
        now, tick = self._now(), self._monotonic()
        self.traffic.sample(tick)
        self.progress.check(tick)
        signals = self.memory.check(tick) if self.memory is not None else {}
        if self.settings.enabled:
            recent = self._memory_restart_at is not None and \
                tick - self._memory_restart_at < self.settings.memory_restart_min_interval_seconds
            for replica, reason in signals.items():
                if recent:
                    log.debug("maintenance: %s wants a restart (%s) but one ran recently", replica, reason)
                else:
                    self.want_rolling_restart("memory", f"{replica}: {reason}")
        if self.controller.busy:
            return "busy"
        verdict = self.last_verdict = self.traffic.verdict(tick)
        window_start = self.window.current_start(now) if self.settings.enabled else None
        due_in_window = window_start is not None and window_start != self._window_done
        if self.wanted is None and not due_in_window:
            return "idle"
        if not verdict.low:
            log.debug("maintenance: restart due but traffic is not low (%s)", verdict.reason)
            return "waiting: " + verdict.reason
        lease = await self.controller.coordinator.peek()
        self.lease_wait = None if lease.granted else lease.detail
        if not lease.granted:  # another node restarts now: wait like for traffic, nothing to record yet
            log.debug("maintenance: restart due but %s", lease.detail)
            return "waiting: " + lease.detail
        if self.wanted is not None:
            trigger, reason = self.wanted
            self.wanted = None
            if trigger == "memory":
                self._memory_restart_at = tick
                trigger = "schedule"
        else:
            assert window_start is not None  # nothing wanted: only a window that is due gets here
            trigger, reason = "schedule", f"maintenance window {window_start.isoformat()}"
        if window_start is not None:
            self._window_done = window_start  # a wanted restart inside the window counts as the window's one
        wanted = (trigger, reason) if window_start is None else None
        try:
            self.controller.start_rolling_restart(
                trigger, reason, then=lambda outcome: self._after_rolling(outcome, window_start, wanted))
        except MaintenanceError as exc:  # e.g. external engines: nothing to restart
            self.controller.record("rolling_restart", trigger, exc.result, detail=exc.message)
            return f"{exc.result}: {exc.message}"
        return f"rolling restart ({trigger}): {reason}"

    def _after_rolling(self, outcome: Outcome, window_start: datetime | None,
                       wanted: tuple[str, str] | None) -> None:
        """A rolling restart skipped for a reason that may pass soon (another node holds the restart lease) did
        not use up its window, or its wish: the next round tries again (still only at low traffic)."""
        if outcome.result != "skipped" or not outcome.retry:
            return
        if window_start is not None and self._window_done == window_start:
            log.info("maintenance: rolling restart skipped (%s); trying again in this window", outcome.detail)
            self._window_done = None
        elif wanted is not None and self.wanted is None:
            self.wanted = wanted

    def next_window(self) -> datetime | None:
        if not self.settings.enabled:
            return None
        now = self._now()
        current = self.window.current_start(now)
        return current if current is not None and current != self._window_done else self.window.next_start(now)

    def status(self) -> dict[str, Any]:
        upcoming = self.next_window()
        verdict = self.last_verdict
        return {
            "enabled": self.settings.enabled,
            "window": f"{self.settings.window_cron} ({self.settings.timezone}) for "
                      f"{self.settings.window_duration_seconds:.0f}s",
            "next_window": upcoming.isoformat() if upcoming else None,
            "next_window_timestamp": upcoming.timestamp() if upcoming else None,
            "in_window": self.settings.enabled and self.window.contains(self._now()),
            "traffic_low": verdict.low if verdict else None,
            "traffic": verdict.reason if verdict else None,
            "restart_wanted": self.wanted[1] if self.wanted else None,
            "restart_lease_wait": self.lease_wait,
            "hung_replicas": self.progress.hung(),
        }
