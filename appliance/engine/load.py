"""An engine's load as its own /metrics page tells it, read on a short interval.

The readings feed routing (KV-cache usage, queue length), hung-replica detection (running requests and the
generated-token counter) and the collectors. The poller only reads and reports; what a reading means is decided
by whoever receives it (the router also uses a reading as the probe that returns an ejected replica).

Only a handful of lines of vLLM's page are needed, so they are picked out by name rather than by parsing the
whole exposition (which is ~100 KB per engine and would cost far more CPU every second).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from appliance.engine.contract import Replica

log = logging.getLogger(__name__)



@dataclass
class EngineLoad:
    """A reading of an engine's own metrics."""

    kv_cache_usage: float | None = None  # 0..1
    waiting: float | None = None
    running: float | None = None
    prompt_tokens_total: float | None = None  # counters: rates are taken by whoever needs them
    generation_tokens_total: float | None = None
    read_at: float = -math.inf  # monotonic


WANTED = {
    b"vllm:kv_cache_usage_perc": "kv_cache_usage",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:num_requests_running": "running",
    b"vllm:prompt_tokens_total": "prompt_tokens_total",
    b"vllm:generation_tokens_total": "generation_tokens_total",
}


def sum_vllm_series(page: bytes, wanted: Mapping[bytes, str]) -> dict[str, float]:
    """The ``wanted`` vLLM series (sample name -> field), each summed over its label sets (one engine may report
    several model/engine/finished_reason labels); unparsable lines are skipped. A line scan, not a full text-format
    parse: this runs on every poll of every engine."""
    values: dict[str, float] = {}
    for line in page.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        field = wanted.get(line.split(b"{", 1)[0].split(b" ", 1)[0])
        if field is None:
            continue
        try:
            values[field] = values.get(field, 0.0) + float(line.rsplit(b" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return values


def parse_engine_load(page: bytes, read_at: float) -> EngineLoad:
    """Sum the wanted gauges over their label sets."""
    return EngineLoad(read_at=read_at, **sum_vllm_series(page, WANTED))


Reading = Callable[[str, "EngineLoad | None"], None]


class EngineLoadPoller:
    """Reads ``targets()``' /metrics every ``interval_seconds`` and reports each result, ``None`` when the page
    could not be read, to ``on_reading``; then calls ``on_poll`` (e.g. admission's dispatch: a replica that just
    became ready takes queued work)."""

    def __init__(self, targets: Callable[[], Sequence[Replica]], on_reading: Reading, interval_seconds: float,
                 on_poll: Callable[[], None] = lambda: None) -> None:
        self.targets = targets
        self.on_reading = on_reading
        self.on_poll = on_poll
        self.interval = interval_seconds
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(1.0, self.interval)))
        self._task = asyncio.create_task(self._run(), name="engine-load-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
                self.on_poll()
            except Exception:  # the poller must never die; a bad page is logged and retried
                log.exception("engine load poll failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def poll_once(self) -> None:
        targets = list(self.targets())
        results = await asyncio.gather(*(self._read(r.url) for r in targets))
        for replica, load in zip(targets, results, strict=True):
            self.on_reading(replica.name, load)

    async def _read(self, url: str) -> EngineLoad | None:
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/metrics") as resp:
                if resp.status != 200:
                    return None
                return parse_engine_load(await resp.read(), time.monotonic())
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
