"""The precise prefix scorer: how many of the prompt's tokens each engine holds in its prefix cache, as its own
KV-cache events say.

It takes the approximate scorer's place (same name, ``prefix``, same weight and load bound) and keeps the
approximate index fed, so that falling back costs nothing. Per candidate:

- the replica's event index is current (``KvEventsHub.usable``) and the prompt was tokenized: the longest prefix of
  the prompt's blocks the index holds, over the blocks an earlier prompt could have left there (``precise``): 1.0
  when it holds all of them (``_held_share``);
- otherwise, in precise-with-fallback, the approximate share (``approximate``); in precise, 0 (no affinity: a
  replica whose cache is unknown is not preferred, and a stale index is never read).

``sources`` counts the decisions by where the chosen replica's score came from, ``fallbacks`` the replica scores
that could not be precise, by why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from appliance.engine.contract import Replica
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.settings import PrefixCacheMode
from appliance.gateway.routing.kv_events.tokens import PromptTokens
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.scorers import PrefixScorer, Score
from appliance.gateway.routing.settings import PrefixScorerSettings
from appliance.gateway.routing.view import RoutingView

SOURCES = ("precise", "approximate", "none")
FALLBACK_REASONS = ("no_tokens", "unknown_replica")


class PreciseScorer(PrefixScorer):
    def __init__(self, settings: PrefixScorerSettings, hub: KvEventsHub, mode: PrefixCacheMode,
                 hasher: BlockHasher) -> None:
        super().__init__(settings)
        self.hub = hub
        self.fallback = mode == "precise-with-fallback"
        self.hasher = hasher
        self.sources: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._sources: dict[str, str] = {}  # this decision's: replica -> where its score came from

    def observe(self, replicas: Sequence[Replica]) -> None:
        super().observe(replicas)
        self.hub.observe(replicas)

    def prune(self, live: Collection[str]) -> None:
        super().prune(live)
        self.hub.prune(live)

    def scores(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> list[Score]:
        self._sources = {}
        return super().scores(candidates, view, request)

    def ratios(self, candidates: Sequence[Replica], request: RoutingRequest) -> list[float] | None:
        approximate = super().ratios(candidates, request)
        prompt = request.tokens
        out = []
        for position, replica in enumerate(candidates):
            index = self.hub.usable(replica.name) if prompt is not None else None
            if prompt is not None and index is not None:
                out.append(_held_share(index, prompt, self.hasher))
                self._sources[replica.name] = "precise"
                continue
            self.fallbacks["no_tokens" if prompt is None else "unknown_replica"] += 1
            if self.fallback:
                out.append(approximate[position] if approximate is not None else 0.0)
                self._sources[replica.name] = "approximate"
            else:
                out.append(0.0)
                self._sources[replica.name] = "none"
        return out

    def chosen(self, replica: Replica, request: RoutingRequest | None) -> None:
        super().chosen(replica, request)
        source = self._sources.get(replica.name)
        if source is not None:
            self.sources[source] += 1


def _held_share(index: ReplicaIndex, prompt: PromptTokens, hasher: BlockHasher) -> float:
    """The longest prefix of the prompt's blocks the engine holds, over the blocks an earlier prompt could have
    left in a cache, at most 1.0: the full blocks before the prompt's last token (the engine computes that token
    whatever it holds), less the last of them: in a conversation's next turn, the block its new text completes,
    which no engine holds yet (engines cache full blocks only, and the turn before ended inside it). So a replica
    that holds all the conversation's earlier turns left scores 1.0, as the approximate scorer's share of the
    characters it sent there nearly does (~0.96).

    Why not the share of the prompt's tokens: with 128-token blocks (vLLM's CPU backend) such a replica held only
    5 of a ~780-token prompt's 6 reusable blocks (0.80 to 0.85 of its tokens), less than the outstanding scorer's
    spread between a replica with all 7 other requests in flight and an idle one (0.875), and load moved whole
    conversations to where they missed (bench/prefix_routing.py, steady state, per-request records)."""
    size = index.block_size
    if size is None or not prompt.ids:
        return 0.0  # no block stored yet: nothing held
    reusable = (len(prompt.ids) - 1) // size
    if reusable <= 0:
        return 0.0  # shorter than a block and a token: nothing of it can be a hit
    return min(index.matched(prompt.keys(hasher, size)) / max(reusable - 1, 1), 1.0)
