"""The request-path hook of precise prefix routing: each prompt is tokenized in a worker thread as it arrives.

Tokenizing an 8k-token prompt takes tens of milliseconds (bench/prefix_precise.py): on the event loop it would
hold every other request for that long. So ``start`` hands the job to the tokenizer's threads and leaves the
future on the request (``RoutingRequest.preparing``), which the transport awaits before the first routing
decision; the precise scorer then reads ``RoutingRequest.tokens``. The worker also computes the prompt's block
keys at the block sizes the engines reported, so that hashing stays off the loop too. A request it cannot
tokenize as the engine does, or that finds ``max_pending_tokenizations`` already in the threads, or arrives while
no replica's event index can be routed on, is not held: it goes on without tokens (the approximate scorer decides
in precise-with-fallback).

It knows the exchange by the three things it reads and the indexes by the two it asks (Protocols), so this package
needs nothing of the transport, and a gateway worker (appliance.gateway.workers) asks its decider's indexes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Protocol

from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer, PromptTokens, TokenJob, token_job
from appliance.gateway.routing.request import RoutingRequest

log = logging.getLogger(__name__)


class IndexView(Protocol):
    """What the hook asks of the event indexes (``KvEventsHub``, or a worker's view of its decider's)."""

    def any_usable(self) -> bool: ...

    def block_sizes(self) -> set[int]: ...


class _Exchange(Protocol):
    route: str
    routing: RoutingRequest

    def parsed(self) -> dict[str, Any] | None: ...


class PromptTokensHook:
    name = "prompt_tokens"

    def __init__(self, tokenizer: PromptTokenizer, hub: IndexView, hasher: BlockHasher, max_pending: int) -> None:
        self.tokenizer = tokenizer
        self.hub = hub
        self.hasher = hasher
        self.max_pending = max_pending
        self.pending = 0
        self.tokenized = 0
        self.seconds = 0.0  # spent tokenizing, summed (the worker's time, not the request's wait)
        self.skipped: Counter[str] = Counter()  # requests routed without tokens, by why

    def start(self, exchange: _Exchange) -> None:
        if not self.hub.any_usable():
            self.skipped["no_index"] += 1
            return
        job = token_job(exchange.route, exchange.parsed())
        if job is None:
            self.skipped["unsupported"] += 1
            return
        if not self.tokenizer.loaded.is_set():  # still importing transformers: never wait for that
            self.skipped["loading"] += 1
            return
        if self.pending >= self.max_pending:
            self.skipped["busy"] += 1
            return
        self.pending += 1
        sizes = self.hub.block_sizes()
        exchange.routing.preparing = asyncio.ensure_future(self._tokenize(exchange.routing, job, sizes))

    async def _tokenize(self, routing: RoutingRequest, job: TokenJob, sizes: set[int]) -> None:
        try:
            prompt, seconds = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer.pool, self._prepare, job, sizes)
        except Exception as exc:  # a template that refuses the messages: the engine will say so; route anyway
            log.debug("prompt not tokenized for routing: %s", exc)
            self.skipped["failed"] += 1
            return
        finally:
            self.pending -= 1
        self.tokenized += 1
        self.seconds += seconds
        routing.tokens = prompt

    def _prepare(self, job: TokenJob, sizes: set[int]) -> tuple[PromptTokens, float]:
        """In a worker: the tokens, and their block keys at the engines' block sizes (hashing is off the loop too)."""
        started = time.perf_counter()
        prompt = PromptTokens(self.tokenizer.tokenize(job), job.salt)
        for size in sizes:
            prompt.keys(self.hasher, size)
        return prompt, time.perf_counter() - started
