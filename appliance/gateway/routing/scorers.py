"""Scorers: each rates every candidate from 0 (worst) to 1 (best), or None when it cannot tell (neutral).

Load scorers read the gateway's own in-flight counts (exact) or the engines' readings (KV-cache usage, queue),
which the router reports as unknown when they are stale or lag behind what the gateway knows it sent; unknown
counts as neutral, so the decision then rests on the in-flight counts. The prefix scorer rates how much of the
prompt's prefix was recently sent to each replica, within a bounded load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from appliance.engine.contract import Replica, ReplicaState
from appliance.gateway.routing.prefix_index import PrefixIndex
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.settings import PrefixScorerSettings
from appliance.gateway.routing.view import RoutingView

Score = float | None
NEUTRAL = 0.5


class Scorer(Protocol):
    name: str

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]: ...

    def observe(self, replicas: Sequence[Replica]) -> None:
        """Every replica, before each decision (to notice restarts)."""
        ...

    def chosen(self, replica: Replica, request: RoutingRequest | None) -> None:
        """The request went to ``replica``."""
        ...


class _Stateless:
    def observe(self, replicas: Sequence[Replica]) -> None:
        return None

    def chosen(self, replica: Replica, request: RoutingRequest | None) -> None:
        return None


class OutstandingScorer(_Stateless):
    """1 - n / (total + 1): a replica's share of the gateway's in-flight requests, inverted. Strictly decreasing in
    its own count, so alone it is least-outstanding-requests."""

    name = "outstanding"

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        counts = [view.in_flight(r.name) for r in candidates]
        total = sum(counts)
        return [1.0 - n / (total + 1) for n in counts]


class KvCacheScorer(_Stateless):
    """1 - KV-cache usage (to 2 decimals, so that noise does not decide); unknown when the reading is not fresh."""

    name = "kv_cache"

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        out: list[Score] = []
        for replica in candidates:
            load = view.engine_load(replica.name)
            usage = None if load is None else load.kv_cache_usage
            out.append(None if usage is None else 1.0 - round(min(max(usage, 0.0), 1.0), 2))
        return out


class QueueScorer(_Stateless):
    """1 - waiting / (longest known queue + 1); unknown when the reading is not fresh."""

    name = "queue"

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        waiting: list[float | None] = []
        for replica in candidates:
            load = view.engine_load(replica.name)
            waiting.append(None if load is None else load.waiting)
        longest = max((w for w in waiting if w is not None), default=0.0)
        return [None if w is None else 1.0 - w / (longest + 1) for w in waiting]


# States in which the engine's cache is gone or about to be (a drain keeps it).
_CACHE_LOST = frozenset({ReplicaState.STARTING, ReplicaState.UNHEALTHY, ReplicaState.BACKOFF,
                         ReplicaState.STOPPING, ReplicaState.STOPPED})


class PrefixScorer:
    """Matched prefix length / prompt length, for the blocks recently sent to each replica.

    Bounded load (consistent hashing with bounded loads, Mirrokni et al.): a replica that would then hold more
    than ceil(load_factor * mean) in-flight requests scores 0, so affinity never piles a hot conversation onto
    one replica while another idles. (At low concurrency that bound is loose; the pipeline's ``BalanceBound``
    bounds each replica's share of recent decisions too.)

    Capacity: each replica's index holds no more blocks than its engine's KV cache (``set_capacity``, from the
    engine's num_gpu_blocks x block_size tokens, converted with ``chars_per_token``), so a prefix the engine must
    have evicted no longer attracts its conversation back there."""

    name = "prefix"

    def __init__(self, settings: PrefixScorerSettings) -> None:
        self.block_chars = settings.block_chars
        self.load_factor = settings.load_factor
        self.chars_per_token = settings.chars_per_token
        self.index = PrefixIndex(settings.index_bytes)
        self.yields = 0  # decisions where a matching replica was passed over for its load
        self.forgotten = 0  # replica restarts that dropped its entries
        self._lives: dict[str, tuple[int, int, float | None, int | None]] = {}  # starts, restarts, start time, pid

    def observe(self, replicas: Sequence[Replica]) -> None:
        for replica in replicas:
            status = replica.status
            life = (status.starts, status.restarts, status.last_start_time, status.pid)
            known = self._lives.get(replica.name)
            lost = status.state in _CACHE_LOST
            if (known is not None and known != life) or (lost and known is not None):
                self.index.forget(replica.name)
                self.forgotten += 1
            if lost:
                self._lives.pop(replica.name, None)
            else:
                self._lives[replica.name] = life

    def prune(self, live: Collection[str]) -> None:
        """Forget replicas gone from the fleet: their blocks leave the index (its budget goes to the live ones)."""
        for name in [name for name in self._lives if name not in live]:
            del self._lives[name]
        self.index.retain(live)

    def set_capacity(self, replica: str, kv_tokens: float | None) -> None:
        """The replica's engine caches ``kv_tokens`` tokens (None: unknown): its index holds at most that many
        tokens' worth of character blocks."""
        blocks = None if kv_tokens is None else int(kv_tokens * self.chars_per_token / self.block_chars)
        if blocks != self.index.capacity_of(replica):
            self.index.set_capacity(replica, blocks)

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        ratios = self.ratios(candidates, request) if request is not None and request.prompt else None
        if ratios is None:
            return [0.0] * len(candidates)
        counts = [view.in_flight(r.name) for r in candidates]
        bound = math.ceil(self.load_factor * (sum(counts) + 1) / len(candidates))
        out: list[Score] = []
        yielded = False
        for ratio, count in zip(ratios, counts, strict=True):
            if ratio > 0 and count + 1 > bound:
                yielded = True
                ratio = 0.0
            out.append(ratio)
        self.yields += yielded
        return out

    def ratios(self, candidates: Sequence[Replica], request: RoutingRequest) -> list[float] | None:
        """Each candidate's share of the prompt it holds, before the load bound (None: too short to match).
        The precise scorer (appliance/gateway/routing/kv_events) answers this from the engines' own events."""
        hashes = request.hashes(self.block_chars)
        if not hashes:
            return None
        return [self.index.matched_blocks(r.name, hashes) * self.block_chars / len(request.prompt) for r in candidates]

    def chosen(self, replica: Replica, request: RoutingRequest | None) -> None:
        if request is not None and request.prompt:
            self.index.record(replica.name, request.hashes(self.block_chars))


class CacheRoomScorer(_Stateless):
    """Where a new conversation should start: for a prompt every candidate holds equally much of (nothing, or
    the same shared system prompt), the free share of each replica's modelled prefix cache, 1 - held / capacity;
    for a prompt one replica holds more of (affinity decides), and where the capacity is unknown, no opinion
    (neutral).

    Placing such a prompt on a full replica evicts its least recently used conversation, which will come back and
    miss. A replica that just restarted has an empty cache: new conversations belong there, and the conversations
    the other replica kept stay where they hit. Measured on 2 real engines (bench/prefix_routing.py): in
    the round after a replica rejoined, the load scorer had sent the unmatched prompts to both replicas alike, and
    each one sent to the full replica evicted one that was still to come."""

    name = "cache_room"

    def __init__(self, prefix: PrefixScorer) -> None:
        self._prefix = prefix

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        index = self._prefix.index
        hashes = request.hashes(self._prefix.block_chars) if request is not None and request.prompt else []
        if not hashes or len({index.matched_blocks(r.name, hashes) for r in candidates}) > 1:
            return [None] * len(candidates)
        out: list[Score] = []
        for replica in candidates:
            capacity = index.capacity_of(replica.name)
            out.append(None if not capacity else max(0.0, 1.0 - index.held(replica.name) / capacity))
        return out


def build_scorers(prefix: PrefixScorerSettings,
                  affinity_scorer: Callable[[PrefixScorerSettings], PrefixScorer] = PrefixScorer) -> dict[str, Scorer]:
    """One of each scorer; the cache-room scorer reads the prefix scorer's index. ``affinity_scorer`` builds the
    prefix scorer: the approximate one, or the precise one (the composition root's, kv_events.PreciseScorer)."""
    affinity = affinity_scorer(prefix)
    return {"outstanding": OutstandingScorer(), "kv_cache": KvCacheScorer(), "queue": QueueScorer(),
            "prefix": affinity, "cache_room": CacheRoomScorer(affinity)}
