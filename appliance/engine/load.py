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
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from appliance.engine.contract import Replica
from appliance.engine.guard import POLICY_HEADER

log = logging.getLogger(__name__)



@dataclass
class EngineLoad:
    """A reading of an engine's own metrics."""

    kv_cache_usage: float | None = None  # 0..1
    waiting: float | None = None
    running: float | None = None
    prompt_tokens_total: float | None = None  # counters: rates are taken by whoever needs them
    generation_tokens_total: float | None = None
    finished_total: float | None = None  # sequences the engine finished (vllm:request_success_total; not aborted)
    read_at: float = -math.inf  # monotonic
    kv_capacity_tokens: float | None = None  # num_gpu_blocks x block_size (vllm:cache_config_info's labels)
    # What the engine's guard says vLLM's scheduler runs (None: it says nothing); from the page's headers, not its
    # series, so not a constructor argument.
    scheduling_policy: str | None = field(default=None, init=False)


WANTED = {
    b"vllm:kv_cache_usage_perc": "kv_cache_usage",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:num_requests_running": "running",
    b"vllm:prompt_tokens_total": "prompt_tokens_total",
    b"vllm:generation_tokens_total": "generation_tokens_total",
    b"vllm:request_success_total": "finished_total",
}


_NUM_GPU_BLOCKS = re.compile(rb'[{,]num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(rb'[{,]block_size="(\d+)"')


def kv_capacity_tokens(line: bytes) -> float | None:
    """Tokens an engine's KV cache holds, from its ``vllm:cache_config_info`` line: num_gpu_blocks x block_size
    (label values; None until the engine has sized its cache). With data parallelism vLLM already sums
    num_gpu_blocks over its engines and repeats the same labels per engine, so callers take the max, not the sum."""
    blocks, size = _NUM_GPU_BLOCKS.search(line), _BLOCK_SIZE.search(line)
    if blocks is None or size is None:
        return None
    return float(int(blocks.group(1)) * int(size.group(1)))


# Series read from a label (an info gauge is always 1): sample name -> (field, line -> value or None); max over
# label sets.
LabelReader = Callable[[bytes], "float | None"]


def sum_vllm_series(page: bytes, wanted: Mapping[bytes, str],
                    from_labels: Mapping[bytes, tuple[str, LabelReader]] | None = None) -> dict[str, float]:
    """The ``wanted`` vLLM series (sample name -> field), each summed over its label sets (one engine may report
    several model/engine/finished_reason labels); unparsable lines are skipped. ``from_labels`` series take their
    value from the line's labels instead (the largest over label sets). A line scan, not a full text-format
    parse: this runs on every poll of every engine."""
    values: dict[str, float] = {}
    for line in page.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        field = wanted.get(name)
        if field is None:
            if from_labels is not None and name in from_labels:
                field, read = from_labels[name]
                value = read(line)
                if value is not None:
                    values[field] = max(values.get(field, value), value)
            continue
        try:
            values[field] = values.get(field, 0.0) + float(line.rsplit(b" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return values


FROM_LABELS: dict[bytes, tuple[str, LabelReader]] = {
    b"vllm:cache_config_info": ("kv_capacity_tokens", kv_capacity_tokens),
}


def parse_engine_load(page: bytes, read_at: float) -> EngineLoad:
    """Sum the wanted gauges over their label sets; the KV capacity from the cache config's labels."""
    return EngineLoad(read_at=read_at, **sum_vllm_series(page, WANTED, FROM_LABELS))


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
        self._task: asyncio.Task[None] | None = None
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
                load = parse_engine_load(await resp.read(), time.monotonic())
                load.scheduling_policy = resp.headers.get(POLICY_HEADER.decode())
                return load
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
