"""Load schedulers: closed loop (fixed concurrency) and open loop (Poisson arrivals), with honest clocks.

Every request gets an *intended* send time before it is sent: in the open loop, its arrival in a seeded
Poisson process; in the closed loop, the moment its worker became free. Latencies count from there, so a
request that waited in the client (for an in-flight slot, or because the scheduler woke late) is charged
with the wait. The scheduler's own lateness (dispatch lag) and the event loop's (loop lag) are recorded too:
when they are large the *client* was the bottleneck and the numbers describe the client, not the server, so
the run is refused rather than reported.

Phases: the first ``warmup`` requests are excluded (cold caches, connection set-up, the ramp); then the
measured requests (a count, or those intended within a duration); then *cool-down* requests keep the load
steady until the last measured request has finished, so no measured request enjoys a draining server.
Cool-down requests still in flight at the end are cancelled and not reported.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.loadtest.client import Clock, RequestResult
from appliance.loadtest.stats import percentile

SendFn = Callable[[RequestResult], Awaitable[RequestResult]]
ResultHook = Callable[[RequestResult], None]
StopRule = Callable[[RequestResult], bool]

# The open loop cannot hold a schedule finer than the event loop's timer resolution.
MIN_LAG_LIMIT_S = 0.002
LOOP_WATCH_INTERVAL_S = 0.01


@dataclass(frozen=True)
class LoadSpec:
    """What load to offer. Exactly one of concurrency/rate and one of requests/duration is set."""

    concurrency: int | None = None
    rate: float | None = None
    requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    max_inflight: int | None = None
    seed: int = 0
    max_lag_s: float = 0.05

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("set exactly one of concurrency and rate")
        if (self.requests is None) == (self.duration is None):
            raise ValueError("set exactly one of requests and duration")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be positive")
        if self.warmup < 0:
            raise ValueError("warmup cannot be negative")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def lag_limit_s(self) -> float:
        """Tolerated P99 scheduling lag: the absolute limit, and for the open loop at most half the mean
        inter-arrival gap (beyond that the arrival process is no longer the one asked for)."""
        if self.rate is None:
            return self.max_lag_s
        return max(MIN_LAG_LIMIT_S, min(self.max_lag_s, 0.5 / self.rate))


@dataclass
class LoadRun:
    """Raw outcome of one run: every completed request and the client's own lateness."""

    spec: LoadSpec
    results: list[RequestResult]
    loop_lags: list[tuple[float, float]]
    measure_start: float | None
    elapsed: float
    stopped_early: bool = False

    @property
    def measured(self) -> list[RequestResult]:
        return sorted((r for r in self.results if r.phase == "measure"), key=lambda r: r.index)

    @property
    def measure_end(self) -> float | None:
        ends = [r.end for r in self.measured if r.end is not None]
        return max(ends) if ends else None

    def dispatch_lags(self) -> list[float]:
        return [r.dispatched - r.intended for r in self.measured if r.dispatched is not None]

    def window_loop_lags(self) -> list[float]:
        start, end = self.measure_start, self.measure_end
        if start is None or end is None:
            return []
        return [lag for t, lag in self.loop_lags if start <= t <= end]

    def client_report(self) -> dict[str, float | int | str | None]:
        """The client's lateness, for the report, and the reason to refuse it (None when fine)."""
        dispatch, loop = self.dispatch_lags(), self.window_loop_lags()
        return {
            "dispatch_lag_p50_s": percentile(dispatch, 50), "dispatch_lag_p99_s": percentile(dispatch, 99),
            "dispatch_lag_max_s": max(dispatch, default=None),
            "loop_lag_p99_s": percentile(loop, 99), "loop_lag_max_s": max(loop, default=None),
            "loop_lag_samples": len(loop), "lag_limit_s": self.spec.lag_limit_s,
            "bottleneck": self.client_bottleneck(),
        }

    def client_bottleneck(self) -> str | None:
        """Why these numbers describe the client rather than the server, or None."""
        limit = self.spec.lag_limit_s
        dispatch, loop = percentile(self.dispatch_lags(), 99), percentile(self.window_loop_lags(), 99)
        if dispatch is not None and dispatch > limit:
            return (f"the client fell behind its schedule: P99 dispatch lag {dispatch * 1e3:.1f} ms > "
                    f"{limit * 1e3:.1f} ms (CPU-starved client or too high a rate for one process)")
        if loop is not None and loop > limit:
            return (f"the client's event loop stalled: P99 loop lag {loop * 1e3:.1f} ms > {limit * 1e3:.1f} ms, "
                    "so chunk timestamps are late too")
        return None


@dataclass
class _Phases:
    """Assigns indices and phases in dispatch order and signals when every measured request is done."""

    spec: LoadSpec
    next_index: int = 0
    outstanding: int = 0
    closed: bool = False
    measure_start: float | None = None
    stopped: bool = False
    error: BaseException | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def assign(self, intended: float) -> tuple[int, str]:
        index, spec = self.next_index, self.spec
        self.next_index += 1
        if index < spec.warmup:
            return index, "warmup"
        if self.measure_start is None:
            self.measure_start = intended
        if spec.requests is not None:
            measured = index < spec.warmup + spec.requests
            self.closed = self.closed or index >= spec.warmup + spec.requests - 1
        else:
            measured = intended < self.measure_start + (spec.duration or 0.0)
            self.closed = self.closed or not measured
        if measured:
            self.outstanding += 1
        self._check()
        return index, "measure" if measured else "cooldown"

    def finished(self, result: RequestResult) -> None:
        if result.phase == "measure":
            self.outstanding -= 1
            self._check()

    def stop(self) -> None:
        """End the run now: the measured requests still in flight are cancelled and not reported."""
        self.stopped = True
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """A request task raised (a bug, not a server error): end the run and re-raise it from run_load."""
        self.error = self.error or error
        self.done.set()

    def _check(self) -> None:
        if self.closed and self.outstanding == 0:
            self.done.set()


async def run_load(spec: LoadSpec, send: SendFn, clock: Clock, on_result: ResultHook | None = None,
                   stop_when: StopRule | None = None) -> LoadRun:
    """Offer ``spec``'s load through ``send`` until every measured request has finished, or until ``stop_when``
    says the outcome is already decided (it sees each measured result as it completes)."""
    phases = _Phases(spec)
    results: list[RequestResult] = []
    loop_lags: list[tuple[float, float]] = []
    inflight: set[asyncio.Task[None]] = set()

    def finish(result: RequestResult) -> None:
        results.append(result)
        phases.finished(result)
        if on_result is not None:
            on_result(result)
        if stop_when is not None and result.phase == "measure" and not phases.done.is_set() and stop_when(result):
            phases.stop()

    if spec.concurrency is not None:
        drivers = [asyncio.create_task(_closed_worker(phases, send, clock, finish)) for _ in range(spec.concurrency)]
    else:
        drivers = [asyncio.create_task(_open_dispatcher(spec, phases, send, clock, finish, inflight))]
    watcher = asyncio.create_task(_watch_loop(clock, loop_lags))
    done = asyncio.create_task(phases.done.wait())
    try:
        await asyncio.wait({done, *drivers}, return_when=asyncio.FIRST_COMPLETED)
        for task in drivers:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error  # a bug in a driver must not look like a slow server
        if phases.error is not None:
            raise phases.error
    finally:
        pending: list[asyncio.Task[Any]] = [done, watcher, *drivers, *inflight]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return LoadRun(spec, results, loop_lags, phases.measure_start, clock(), phases.stopped)


async def _closed_worker(phases: _Phases, send: SendFn, clock: Clock, finish: ResultHook) -> None:
    """One of C workers: send, wait for the end, send the next one at once (intended = previous end)."""
    intended = clock()
    while not phases.done.is_set():
        index, phase = phases.assign(intended)
        result = RequestResult(index=index, phase=phase, intended=intended, dispatched=clock())
        await send(result)
        finish(result)
        intended = result.end if result.end is not None else clock()


async def _open_dispatcher(
    spec: LoadSpec, phases: _Phases, send: SendFn, clock: Clock, finish: ResultHook, inflight: set[asyncio.Task[None]]
) -> None:
    """Poisson arrivals at ``spec.rate`` from a seeded generator; each arrival is sent without waiting for others
    (up to ``max_inflight`` at once; beyond that it queues in the client, and the wait counts as latency)."""
    rng = random.Random(spec.seed)
    slots = asyncio.Semaphore(spec.max_inflight) if spec.max_inflight else None
    arrival = clock()
    while not phases.done.is_set():
        delay = arrival - clock()
        if delay > 0:
            try:
                await asyncio.wait_for(phases.done.wait(), delay)
                return
            except TimeoutError:
                pass
        index, phase = phases.assign(arrival)
        result = RequestResult(index=index, phase=phase, intended=arrival, dispatched=clock())
        task = asyncio.create_task(_send_when_free(slots, send, result, finish, phases))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
        arrival += rng.expovariate(spec.rate or 1.0)


async def _send_when_free(slots: asyncio.Semaphore | None, send: SendFn, result: RequestResult,
                          finish: ResultHook, phases: _Phases) -> None:
    try:
        if slots is None:
            await send(result)
        else:
            async with slots:
                await send(result)
        finish(result)
    except Exception as exc:  # surfaced by run_load: a lost task would hang the run
        phases.fail(exc)


async def _watch_loop(clock: Clock, lags: list[tuple[float, float]]) -> None:
    """Measures how late the event loop wakes a 10 ms sleeper: a saturated client shows here first."""
    while True:
        before = clock()
        await asyncio.sleep(LOOP_WATCH_INTERVAL_S)
        now = clock()
        lags.append((now, max(0.0, now - before - LOOP_WATCH_INTERVAL_S)))
