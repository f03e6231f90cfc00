"""The batch runner: moves batches through their life cycle and sends their lines on idle capacity only.

One task in the gateway's event loop. Each step (every ``batch.poll_seconds``, or at once when woken: a batch
created or cancelled, a line answered) it

1. advances every batch not yet ended: ``validating`` -> ``in_progress``; past its window -> ``finalizing`` then
   ``expired``; every line answered -> ``finalizing`` then ``completed``; ``cancelling`` -> ``cancelled``; its
   tenant gone -> ``failed``. Finalizing writes the output and error files from the stored results (lines never
   answered get ``batch_expired`` / ``batch_cancelled`` errors) and records them with the end status in one
   transaction; a batch found finalizing after a crash is finalized again, into the same files;
2. sends lines while capacity is idle: no request waits in the admission queue, a replica is below its limit less
   ``batch.headroom_fraction``, fewer than ``batch.max_concurrency`` lines are in flight; spread over the running
   batches (the one with fewest lines in flight first).

It backs off at once: when an interactive request has to queue, admission calls ``preempt`` and every line in
flight is given back (the engine aborts it; it runs again after ``batch.backoff_seconds``). A line's result is
recorded once (the store writes only pending lines), so a line sent again (after a preemption, or a crash) still
appears once in its file. Nothing is kept only in memory: after a restart the runner resumes from the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Protocol

from appliance.batch.blobs import FileBlobs
from appliance.batch.lines import answer_result, error_result
from appliance.batch.metrics import BatchMetrics
from appliance.batch.model import (
    ERROR,
    OUTPUT,
    OUTPUT_PURPOSE,
    RUNNING,
    BatchRecord,
    FileRecord,
    PendingLine,
    Status,
    Summary,
    result_file_id,
)
from appliance.batch.service import Storage
from appliance.batch.settings import BatchSettings
from appliance.batch.store import BatchStore
from appliance.batch.submit import NO_IDLE_CAPACITY, Answer, IdleGate, Submission

log = logging.getLogger(__name__)

RETENTION_SWEEP_SECONDS = 60.0  # how often files past batch.file_retention_hours are looked for
EXPIRE_CHUNK = 500  # files forgotten per transaction: a large backlog never holds the write lock long
SERVER_ERRORS = frozenset({500, 502, 504})  # tried again, up to batch.max_attempts
LATER = frozenset({429, 499, 503})  # no room now (capacity, quota, no replica, draining): not a try
UNANSWERED = {Status.EXPIRED: ("batch_expired", "the batch's completion window ended before this line was answered"),
              Status.CANCELLED: ("batch_cancelled", "the batch was cancelled before this line was answered")}


class Submitter(Protocol):
    async def send(self, line: PendingLine, endpoint: str, tenant_name: str, submission: Submission) -> Answer: ...


class BatchRunner:
    def __init__(self, settings: BatchSettings, storage: Storage, submitter: Submitter, gate: IdleGate, *,
                 tenant_known: Callable[[str], bool], draining: Callable[[], bool],
                 metrics: BatchMetrics | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.storage = storage
        self.submitter = submitter
        self.gate = gate
        self.tenant_known = tenant_known
        self.draining = draining
        self.metrics = metrics
        self.clock = clock
        self.monotonic = monotonic
        self.summary = Summary()  # the last reading of the store, for the metrics
        self._summary_at = -math.inf
        self._in_flight: dict[tuple[str, int], tuple[str, Submission]] = {}  # (batch, line) -> (tenant, client side)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._paused_until = -math.inf  # monotonic: no line is sent before (a preemption, no idle capacity)
        self._held_until = -math.inf  # monotonic: no new line before (an interactive request arrived)
        self._hold_began = -math.inf  # monotonic: when the current run of holds began
        self._open_until = -math.inf  # monotonic: arrivals hold nothing before (a hold ran to its longest)
        self._resume: asyncio.TimerHandle | None = None  # wakes the runner when a pause or a hold ends
        self._tenant_paused: dict[str, float] = {}  # a tenant whose quota is spent: until when
        self._expired_at = -math.inf  # monotonic: the last look for files past their retention

    # -- life -----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    async def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop sending; give back the lines in flight (they run again after the next start)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._resume is not None:
            self._resume.cancel()
        self._give_back(lambda _batch: True, "stopped")
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=grace_seconds)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)

    def wake(self) -> None:
        self._wake.set()

    def in_flight(self) -> dict[str, int]:
        """Lines in flight per tenant."""
        return dict(Counter(tenant for tenant, _ in self._in_flight.values()))

    def preempt(self) -> None:
        """An interactive request has to wait in the admission queue: every line in flight is given back now, and
        no line is sent for ``batch.backoff_seconds``."""
        self._paused_until = self.monotonic() + self.settings.backoff_seconds
        if self.settings.preempt:
            self._give_back(lambda _batch: True, "preempted")

    def yield_to_interactive(self) -> None:
        """An interactive request arrived: no new line is sent for ``batch.yield_seconds`` (lines in flight go
        on), so that its prefill and first token do not wait behind batch lines starting. Arrivals in a row hold
        at most ``batch.max_yield_seconds``; then lines are sent for ``batch.yield_seconds`` whatever arrives, so
        a steady interactive stream never stops a batch."""
        hold = self.settings.yield_seconds
        now = self.monotonic()
        if hold <= 0 or now < self._open_until:
            return
        if now >= self._held_until:
            self._hold_began = now
        longest = self._hold_began + self.settings.max_yield_seconds
        self._held_until = min(max(self._held_until, now + hold), longest)
        if self._held_until >= longest:
            self._open_until = longest + hold

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bug or a storage error: logged, and tried again at the next step
                log.exception("batch runner step failed")
            with suppress(TimeoutError):
                async with asyncio.timeout(self.settings.poll_seconds):
                    await self._wake.wait()
            self._wake.clear()

    async def step(self) -> None:
        """Advance every batch, then send what idle capacity allows."""
        if not self.storage.exists():
            return
        active = [await self._advance(batch)
                  for batch in await self.storage.call(lambda store, _: store.active_batches())]
        if self.monotonic() - self._summary_at >= self.settings.poll_seconds:
            self._summary_at = self.monotonic()
            self.summary = await self.storage.call(lambda store, _: store.summary())
        await self._expire_files()
        if self.draining():
            self._give_back(lambda _batch: True, "draining")
            return
        running = [batch for batch in active if batch.status is Status.IN_PROGRESS]
        await self._fill(running)

    # -- the life cycle -------------------------------------------------------------------------------------------

    async def _advance(self, batch: BatchRecord) -> BatchRecord:
        """The batch moved as far as it can now; returns it as it is then."""
        now = int(self.clock())
        if batch.status in RUNNING and not self.tenant_known(batch.tenant):
            return await self._fail(batch, now) or batch
        if batch.status is Status.VALIDATING:
            batch = await self._move(batch, Status.IN_PROGRESS, now, sources={Status.VALIDATING}) or batch
        if batch.status in RUNNING and now >= batch.expires_at:
            batch = await self._move(batch, Status.FINALIZING, now, sources=RUNNING, outcome=Status.EXPIRED) or batch
        elif batch.status is Status.IN_PROGRESS and batch.pending == 0:
            batch = await self._move(batch, Status.FINALIZING, now, sources={Status.IN_PROGRESS},
                                     outcome=Status.COMPLETED) or batch
        if batch.status in (Status.FINALIZING, Status.CANCELLING):
            return await self._finalize(batch, now) or batch
        return batch

    async def _move(self, batch: BatchRecord, to: Status, now: int, *, sources: set[Status] | frozenset[Status],
                    outcome: Status | None = None) -> BatchRecord | None:
        return await self.storage.call(lambda store, _: store.transition(batch.id, to, now, sources=sources,
                                                                         outcome=outcome))

    async def _finalize(self, batch: BatchRecord, now: int) -> BatchRecord | None:
        """Close the lines never answered, write the result files, end the batch."""
        outcome = Status.CANCELLED if batch.status is Status.CANCELLING else batch.outcome or Status.COMPLETED
        reason = {Status.CANCELLED: "cancelled", Status.EXPIRED: "expired"}.get(outcome, "stopped")
        self._give_back(lambda id_: id_ == batch.id, reason)

        def finalize(store: BatchStore, blobs: FileBlobs) -> tuple[BatchRecord | None, int]:
            closed = _close_unanswered(store, batch, outcome)
            files = {kind: _write_results(store, blobs, batch, kind, now) for kind in (OUTPUT, ERROR)}
            return store.finish(batch.id, outcome, now, output=files[OUTPUT], error=files[ERROR]), closed

        try:
            ended, closed = await self.storage.call(finalize)
        except OSError as exc:  # a full disk, say: the batch stays finalizing and is tried again next step
            log.error("batch %s: its result files could not be written (%s); trying again", batch.id, exc)
            return None
        if ended is not None:
            if self.metrics is not None and closed:
                self.metrics.answered.labels(batch.tenant, ERROR).inc(closed)
            log.info("batch %s (%s) %s: %d completed, %d failed of %d", batch.id, batch.tenant, outcome.value,
                     ended.completed, ended.failed, ended.total)
        return ended

    async def _fail(self, batch: BatchRecord, now: int) -> BatchRecord | None:
        self._give_back(lambda id_: id_ == batch.id, "failed")
        errors: list[dict[str, object]] = [{"code": "tenant_removed", "line": None, "param": None,
                                            "message": f"tenant {batch.tenant!r} is no longer configured"}]
        failed = await self.storage.call(lambda store, _: store.fail(batch.id, now, errors))
        if failed is not None:
            log.warning("batch %s failed: its tenant %r is no longer configured", batch.id, batch.tenant)
        return failed

    async def _expire_files(self) -> None:
        """Delete the files past ``batch.file_retention_hours`` (never a running batch's input), at most once every
        ``RETENTION_SWEEP_SECONDS``: each record first, then its bytes, so a crash between the two leaves only bytes
        nobody refers to, which the next start sweeps."""
        retention = self.settings.file_retention_hours * 3600
        if retention <= 0 or self.monotonic() - self._expired_at < RETENTION_SWEEP_SECONDS:
            return
        self._expired_at = self.monotonic()
        created_by = int(self.clock()) - retention  # expires_at (created_at + retention) has come

        def expire(store: BatchStore, blobs: FileBlobs) -> int:
            removed = 0
            while files := store.expired_files(created_by, EXPIRE_CHUNK):
                store.forget_files([record.id for record in files])
                for record in files:
                    blobs.remove(record.id)
                removed += len(files)
                if len(files) < EXPIRE_CHUNK:
                    break
            return removed

        removed = await self.storage.call(expire)
        if removed:
            log.info("batch files: deleted %d file(s) older than %d h (batch.file_retention_hours)", removed,
                     self.settings.file_retention_hours)
            if self.metrics is not None:
                self.metrics.files_expired.inc(removed)

    # -- sending lines --------------------------------------------------------------------------------------------

    async def _fill(self, running: list[BatchRecord]) -> None:
        now = self.monotonic()
        until = max(self._paused_until, self._held_until)
        if now < until:
            self._wake_at(until - now)
            return
        room = min(self.settings.max_concurrency - len(self._in_flight), self.gate.idle_room())
        if room <= 0:
            return
        per_batch = Counter(batch_id for batch_id, _ in self._in_flight)
        ready = [batch for batch in running if self._tenant_paused.get(batch.tenant, -math.inf) <= now]
        ready.sort(key=lambda batch: per_batch[batch.id])  # stable: oldest first among equals
        for position, batch in enumerate(ready):
            share = max(1, room // (len(ready) - position))
            busy = {index for batch_id, index in self._in_flight if batch_id == batch.id}
            lines = await self.storage.call(functools.partial(_pending, batch_id=batch.id, now=self.clock(),
                                                              exclude=busy, limit=share))
            for line in lines:
                if (batch.id, line.index) in self._in_flight:  # sent meanwhile by a step that ran during the read
                    continue
                self._launch(batch, line)
                room -= 1
            if room <= 0:
                return

    def _wake_at(self, delay: float) -> None:
        """Step again in ``delay`` seconds (when a pause or a hold ends), not only at the next poll."""
        if self._resume is not None:
            self._resume.cancel()
        self._resume = asyncio.get_running_loop().call_later(delay, self.wake)

    def _launch(self, batch: BatchRecord, line: PendingLine) -> None:
        submission = Submission()
        self._in_flight[(batch.id, line.index)] = (batch.tenant, submission)
        task = asyncio.get_running_loop().create_task(self._send(batch, line, submission))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: BatchRecord, line: PendingLine, submission: Submission) -> None:
        try:
            try:
                answer = await self.submitter.send(line, batch.endpoint, batch.tenant, submission)
            except Exception:
                log.exception("batch %s line %d: sending it failed", batch.id, line.index)
                answer = Answer(500, b'{"error": {"message": "internal error sending the line"}}')
            finally:
                self._in_flight.pop((batch.id, line.index), None)
            await self._settle(batch, line, submission, answer)
        except Exception:  # storage failed: the line stays pending and is sent again
            log.exception("batch %s line %d: its answer could not be recorded", batch.id, line.index)
        finally:
            self.wake()

    async def _settle(self, batch: BatchRecord, line: PendingLine, submission: Submission, answer: Answer) -> None:
        """Record the line's answer, or leave it pending: given back, no room now, or a server error to retry."""
        if submission.abandoned is not None and answer.status == 499:  # an answer complete before it is kept
            if self.metrics is not None:
                self.metrics.given_back.labels(submission.abandoned).inc()
            await self._release(batch, line)
            return
        if answer.status in LATER:
            self._defer(batch, answer)
            await self._release(batch, line)
            return
        if answer.status in SERVER_ERRORS and line.attempts + 1 < self.settings.max_attempts:
            not_before = self.clock() + self.settings.backoff_seconds * 2 ** line.attempts
            await self.storage.call(lambda store, _: store.defer_line(batch.id, line.index,
                                                                      attempts=line.attempts + 1,
                                                                      not_before=not_before))
            if self.metrics is not None:
                self.metrics.deferred.labels("server_error").inc()
            return
        result = answer_result(line, answer.status, answer.body)
        recorded = await self.storage.call(lambda store, _: store.record_results(batch.id, [(line.index, result)]))
        if recorded and self.metrics is not None:
            self.metrics.answered_line(batch.tenant, result.kind, result.usage)

    async def _release(self, batch: BatchRecord, line: PendingLine) -> None:
        """The line goes back unanswered: where several gateways share the store, one with room may take it now
        rather than when this one's claim ends."""
        await self.storage.call(lambda store, _: store.release(batch.id, [line.index]))

    def _defer(self, batch: BatchRecord, answer: Answer) -> None:
        now = self.monotonic()
        if answer.code == "rate_limit_exceeded":  # this tenant's quota: only its batches wait
            self._tenant_paused[batch.tenant] = now + max(answer.retry_after or 0, self.settings.backoff_seconds)
            reason = "rate_limited"
        else:
            self._paused_until = max(self._paused_until, now + self.settings.backoff_seconds)
            reason = NO_IDLE_CAPACITY if answer.code in (NO_IDLE_CAPACITY, "over_capacity") else "unavailable"
        if self.metrics is not None:
            self.metrics.deferred.labels(reason).inc()

    def _give_back(self, which: Callable[[str], bool], why: str) -> None:
        for (batch_id, _), (_, submission) in list(self._in_flight.items()):
            if which(batch_id):
                submission.abandon(why)


def _pending(store: BatchStore, _: FileBlobs, *, batch_id: str, now: float, exclude: set[int], limit: int
             ) -> list[PendingLine]:
    return store.pending_lines(batch_id, now=now, exclude=exclude, limit=limit)


def _close_unanswered(store: BatchStore, batch: BatchRecord, outcome: Status) -> int:
    """The lines of an expired or cancelled batch never answered: each gets its error. Returns how many."""
    if outcome not in UNANSWERED:
        return 0
    code, message = UNANSWERED[outcome]
    pending = store.pending_lines(batch.id, now=math.inf, exclude=(), limit=None)
    results = [(line.index, error_result(batch.id, line.index, line.custom_id, code, message)) for line in pending]
    return len(store.record_results(batch.id, results)) if results else 0


def _write_results(store: BatchStore, blobs: FileBlobs, batch: BatchRecord, kind: str, now: int) -> FileRecord | None:
    """One result file on disk (atomically, under its derived id), or None when no line goes there."""
    lines = store.results(batch.id, kind)
    if not lines:
        return None
    data = ("\n".join(lines) + "\n").encode()
    record = FileRecord(result_file_id(batch.id, kind), batch.tenant, OUTPUT_PURPOSE, f"{batch.id}_{kind}.jsonl",
                        len(data), now)
    blobs.write(record.id, data)
    return record
