"""The gateway's event-loop lag: how late a sleeping timer on its one asyncio loop wakes up.

Every first token, every relayed stream event and every /health answer is a callback on that one loop. When the
loop is CPU-saturated or blocked by a slow synchronous call, each callback that became ready waits for it, and the
TTFT and inter-token latency of every stream grow together, with nothing in the request metrics to say why.

A probe task asks to sleep ``interval`` seconds and measures how much later than that it woke. A timer that is due
is just one more ready callback: its lateness is how long any callback that became ready at that moment waited for
the loop. One observation per wake-up, so a stall of S seconds shows as an observation of at least S - interval.
Asking for the sleep again after each wake-up costs a few microseconds (ten times a second by default).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EventLoopLag:
    """Observes the running loop's lag into ``appliance_event_loop_lag_seconds`` every ``interval_seconds``,
    between ``start()`` (on the loop to watch) and ``stop()``."""

    def __init__(self, registry: CollectorRegistry, interval_seconds: float) -> None:
        if interval_seconds <= 0:
            raise ValueError(f"the event-loop probe interval must be > 0 seconds, got {interval_seconds}")
        self.interval = interval_seconds
        self.lag = Histogram("appliance_event_loop_lag_seconds",
                             "How late a timer on the gateway's event loop fired, sampled every "
                             "gateway.event_loop_probe_seconds: how long any ready callback (a first token, a "
                             "relayed stream event, a /health answer) waited for the loop. High: the gateway's "
                             "CPU is saturated or a synchronous call blocks the loop, and every stream's TTFT and "
                             "ITL grow with it.", buckets=LAG_BUCKETS, registry=registry)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval)
            self.lag.observe(max(0.0, loop.time() - asked - self.interval))
