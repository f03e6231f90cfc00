"""Each replica's KV-cache events, kept in step: one ZeroMQ subscription per replica, on the gateway's event loop.

vLLM numbers its event batches from 0 (a new engine process numbers anew) and keeps the last ones for replay
(``buffer_steps``): a subscriber sends the first number it wants to the replay socket and gets every later batch
it still holds, then an end marker. A subscription applies batch n only after n - 1, so its index is the engine's
cache as of its last batch (``index.py``), and it is trusted only while that holds:

- connected, and in step: a (re)connection, a gap in the numbers, or a batch numbered below the next one expected
  (not one already applied) makes it untrusted until a sync: the replay of every batch after the last one applied,
  whose first must be that very batch (same number, same timestamp), else the engine is another process (it
  restarted) or no longer holds it, and the index starts again from the engine's first batch;
- an engine whose replay starts at batch 0 (or is empty) gives its whole history: exact again at once. One that
  no longer holds batch 0, a replay that does not answer in ``replay_timeout_seconds``, or a batch that cannot be
  decoded: the index starts again empty from the next batch and is trusted only after ``resync_seconds`` (it then
  misses the blocks stored before, never claims one evicted since);
- a replica that restarts (the router sees its status change: ``restarted``) or sends AllBlocksCleared is emptied
  at once.

Events are applied on the event loop: decoding (msgspec) and a dict update per block, a few microseconds per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from appliance.gateway.routing.kv_events import wire
from appliance.gateway.routing.kv_events.index import ReplicaIndex

log = logging.getLogger(__name__)

END_SEQ = -1  # vLLM's end-of-replay marker (signed)
RECEIVE_HWM = 100_000  # batches queued for the gateway before ZeroMQ drops (vLLM's own publisher default)
_TICK_MS = 250  # how often the loop looks at its flags with nothing to read (a restart asks for a sync)
_DRAIN_MAX = 1000  # batches read in one go before the loop yields
_RECENT = 4096  # numbers and timestamps of the last batches applied: a replayed batch read again live is skipped
_MAX_REPLAY_BATCHES = 200_000  # a replay longer than this is treated as failed (vLLM keeps 10k by default)


@dataclass(frozen=True)
class EventEndpoints:
    """Where one engine publishes (``events``) and replays (``replay``; None: it does not), as ZeroMQ addresses."""

    events: str
    replay: str | None


class Subscription:
    """One replica's events into its ``ReplicaIndex``."""

    def __init__(self, name: str, endpoints: EventEndpoints, index: ReplicaIndex, context: zmq.asyncio.Context, *,
                 replay_timeout_seconds: float, resync_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.endpoints = endpoints
        self.index = index
        self._context = context
        self._replay_timeout = replay_timeout_seconds
        self._resync = resync_seconds
        self._clock = clock
        self.connected = False
        self.expected: int | None = None  # the next batch's number; None: the engine's history is unknown
        self.syncs = 0
        self.syncing = False
        self._need_sync = False
        self._adopt = False  # after a loss: the next batch starts the index again, whatever its number
        self._trust_after = 0.0  # monotonic: after a loss, the index is not routed on before this
        self._missing = 1  # batches the pending sync is to bring back (what a failed one counts as lost)
        self._recent: OrderedDict[int, float] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    # -- life ------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def restarted(self, reason: str = "restart") -> None:
        """The replica's engine is another process now (or none): its cache is empty, its history starts anew."""
        self._forget(reason)
        self._need_sync = self.connected

    # -- the loop --------------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # an engine's address may be IPv6 (IPv4 ones still connect)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoints.events)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(_TICK_MS))
                if monitor in ready:
                    await self._on_monitor(monitor)
                if self._need_sync and self.connected:
                    await self._sync()
                if sub in ready:
                    await self._drain(sub)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: say so, and never route on this index again until the gateway restarts
            log.exception("%s: KV event subscription failed; its prefix cache is unknown from now on", self.name)
            self.index.trusted_from = None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while _readable(monitor):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.index.trusted_from = None  # batches sent meanwhile are lost to this socket
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self._need_sync = True  # whatever was sent while apart: replayed

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(_DRAIN_MAX):
            if not _readable(sub):
                return
            frames = await sub.recv_multipart()
            if len(frames) != 3:
                self._lost("malformed", 1)
                continue
            self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
            if self._need_sync and self.connected:
                await self._sync()

    # -- sequencing ------------------------------------------------------------------------------------------------

    def _on_batch(self, seq: int, payload: bytes) -> None:
        expected = self.expected
        if self._need_sync:
            return  # the sync's replay brings it again
        if expected is not None and seq < expected and self._applied(seq, payload):
            return  # read live after its replay
        if expected is not None and seq < expected:
            self._forget("publisher_restart")  # numbered anew: another engine process
            expected = None
        if self._adopt or (expected is None and seq == 0):
            self._adopt = False
            if self._apply(seq, payload) and seq == 0:  # the engine's first batch: its whole history from here
                self._trust_after = 0.0
                self._trust()
        elif expected is None or seq > expected:
            self._missing = seq - (expected or 0) + 1  # those before it, and itself (the replay brings it again)
            self._need_sync = True
        else:
            self._apply(seq, payload)

    def _applied(self, seq: int, payload: bytes) -> bool:
        ts = self._recent.get(seq)
        if ts is None:
            return False
        try:
            return wire.timestamp(payload) == ts
        except wire.DecodeError:
            return False

    def _apply(self, seq: int, payload: bytes) -> bool:
        try:
            batch = wire.decode(payload)
        except wire.DecodeError:
            log.warning("%s: KV event batch %d cannot be decoded (a vLLM this gateway does not know?)", self.name, seq)
            self._lost("undecodable", 1)
            return False
        self.index.apply_batch(batch, self._clock(), time.time())
        self.expected = seq + 1
        self._recent[seq] = batch.ts
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return True

    def _trust(self) -> None:
        """In step with the engine's events: routed on from now, or once a resync period after a loss is over."""
        self.index.trusted_from = max(self._clock(), self._trust_after)

    def _forget(self, reason: str) -> None:
        self.index.reset(reason)
        self.index.trusted_from = None
        self.expected = None
        self._adopt = False
        self._trust_after = 0.0
        self._recent.clear()

    def _lost(self, reason: str, batches: int) -> None:
        """Events are missing for good: start again empty from the next batch, trusted after the resync period."""
        self.index.lost_batches += batches
        self._forget(reason)
        self._adopt = True
        self._trust_after = self._clock() + self._resync
        self._trust()

    # -- replay ----------------------------------------------------------------------------------------------------

    async def _sync(self) -> None:
        self._need_sync = False
        self._adopt = False
        self.syncs += 1
        self.syncing = True
        try:
            await self._replay_missed()
        finally:
            self.syncing = False

    async def _replay_missed(self) -> None:
        """Bring the index in step by replay. A restart the router reports meanwhile (``restarted``, which asks for
        another sync) ends this one wherever it waits: what it fetched belongs to the engine before."""
        missing, self._missing = self._missing, 1
        self.index.trusted_from = None
        if self.expected:  # continue from the last batch applied, if the engine still holds that very batch
            last = self.expected - 1
            batches = await self._replay(last)
            if self._need_sync:
                return None
            if batches is None:
                return self._lost("replay_failed", missing)
            if batches and batches[0][0] == last and self._applied(last, batches[0][1]):
                if self._apply_all(batches[1:], last + 1):
                    self._trust()
                return None
            self._forget("publisher_restart")  # another engine process, or one that no longer holds our batch
        batches = await self._replay(0)
        if self._need_sync:
            return None
        if batches is None:
            return self._lost("replay_failed", missing)
        if len(self.index):
            self._forget("sync")
        first = batches[0][0] if batches else 0
        if not self._apply_all(batches, first):
            return None
        if not batches:
            self.expected = 0  # the engine has published nothing: its cache is empty
        if first > 0:  # the engine no longer holds its first batches: what they stored stays unknown
            self.index.lost_batches += first
            self.index.resets["replay_gap"] += 1
            self._trust_after = self._clock() + self._resync
        else:  # its whole history: exact, whatever was lost before
            self._trust_after = 0.0
        self._trust()
        return None

    def _apply_all(self, batches: list[tuple[int, bytes]], first: int) -> bool:
        """Apply consecutive batches from number ``first``; False (and the loss handled) on a gap or a bad one."""
        for offset, (seq, payload) in enumerate(batches):
            if seq != first + offset or not self._apply(seq, payload):
                if seq != first + offset:
                    self._lost("replay_gap", 1)
                return False
        return True

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every batch from ``start`` on that the engine still holds, in order; None: no answer in time."""
        if self.endpoints.replay is None:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self.endpoints.replay)
        deadline = self._clock() + self._replay_timeout
        batches: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(batches) <= _MAX_REPLAY_BATCHES:
                remaining = deadline - self._clock()
                if remaining <= 0 or not await dealer.poll(remaining * 1000):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return batches
                batches.append((seq, frames[3]))
            return None
        finally:
            dealer.close(linger=0)


def _readable(sock: zmq.asyncio.Socket) -> bool:
    """A message is waiting (ZMQ_EVENTS: an int for this option)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
