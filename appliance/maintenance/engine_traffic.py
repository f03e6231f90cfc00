"""A node pod's traffic, as its engines count it.

Gateway pods call a node's engines directly: the node's own gateway counter sees none of that traffic, so on a
node it would always read low. The engines see every request whoever sent it. Each maintenance round this reads
each engine's own /metrics (vLLM's ``vllm:request_success_total``, ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) and offers ``TrafficSampler`` the two readings it takes:

- ``requests_total``: requests that *arrived* at the engines (finished + running + waiting), kept as one counter
  across engine restarts (a counter that went down is a restarted engine: its new value is all new). Counting
  arrivals rather than completions sees a long request when it starts. vLLM 0.32 does not count client aborts
  in ``request_success_total``; an aborted request still counted while it ran or waited.
- ``queue_length``: the engines' waiting requests plus the node gateway's own queue.
- ``in_flight(name)``: what one engine reports running or waiting, for the drain before its restart (gateway
  pods' requests never pass the node's router, which is all the drain counted before).

An engine whose page cannot be read adds nothing and keeps its last reading (a restarting engine).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from appliance.engine.contract import Replica
from appliance.engine.load import sum_vllm_series

log = logging.getLogger(__name__)

WANTED = {b"vllm:request_success_total": "finished", b"vllm:num_requests_running": "running",
          b"vllm:num_requests_waiting": "waiting"}


@dataclass(frozen=True)
class EngineCounts:
    finished: float = 0.0
    running: float = 0.0
    waiting: float = 0.0

    @property
    def arrived(self) -> float:
        return self.finished + self.running + self.waiting


def parse_counts(page: bytes) -> EngineCounts:
    """Sum the wanted series over their label sets (finished_reason, model, engine)."""
    return EngineCounts(**sum_vllm_series(page, WANTED))


class EngineTraffic:
    def __init__(self, replicas: Callable[[], Sequence[Replica]], *, gateway_queue: Callable[[], int] = lambda: 0,
                 timeout_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._replicas = replicas
        self._gateway_queue = gateway_queue
        self._clock = clock
        self._read_at: dict[str, float] = {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._last: dict[str, EngineCounts] = {}
        self._arrived = 0.0

    async def refresh(self) -> None:
        replicas = list(self._replicas())
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            pages = await asyncio.gather(*(self._read(session, r.url) for r in replicas))
        for replica, counts in zip(replicas, pages, strict=True):
            if counts is not None:
                self.record(replica.name, counts)
        for gone in set(self._last) - {r.name for r in replicas}:
            del self._last[gone]
            self._read_at.pop(gone, None)

    def record(self, name: str, counts: EngineCounts) -> None:
        """Fold one engine's reading into the arrivals counter."""
        last = self._last.get(name)
        if last is None:
            pass  # the first reading is the baseline: what came before is not this look-back's traffic
        elif counts.finished < last.finished:
            self._arrived += counts.arrived  # the engine restarted: everything it counts is new
        else:
            self._arrived += max(0.0, counts.arrived - last.arrived)
        self._last[name] = counts
        self._read_at[name] = self._clock()

    def requests_total(self) -> float:
        return self._arrived

    def in_flight(self, name: str, max_age_seconds: float) -> int | None:
        """Requests ``name``'s engine reported running or waiting at its last reading; None if that reading is
        older than ``max_age_seconds`` (or there is none: a stopped engine serves nothing we could wait for)."""
        read_at, counts = self._read_at.get(name), self._last.get(name)
        if read_at is None or counts is None or self._clock() - read_at > max_age_seconds:
            return None
        return math.ceil(counts.running + counts.waiting)

    def queue_length(self) -> int:
        return int(sum(c.waiting for c in self._last.values())) + self._gateway_queue()

    async def _read(self, session: aiohttp.ClientSession, url: str) -> EngineCounts | None:
        try:
            async with session.get(f"{url}/metrics") as response:
                if response.status != 200:
                    return None
                return parse_counts(await response.read())
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("maintenance: reading %s/metrics failed: %s", url, exc)
            return None
