"""Policies: how the candidates that passed the filters become one choice.

``WeightedPolicy`` sums each scorer's score times its weight (unknown scores count as neutral, 0.5); equal totals
are ordered by the tie-breaker scorers in turn, then by the replica's position. With the default weights
(outstanding 1, prefix 1, KV and queue 0 as tie-breakers) and prompts that share nothing, that is exactly the
older fixed policy: fewest outstanding requests, then lower KV-cache usage, then shorter queue, then lower index.

With the prefix scorer on, requests whose prompt is at least one block long first pass ``BalanceBound`` (each
replica within its share of the recent prefix-routed decisions): affinity then decides among replicas that are
not already over their share, at any concurrency; and where everything else ties, the replica that took fewer of
those recent decisions wins before the lower index does (a prompt no replica holds starts its new home on the
least used replica: without it, ties at low concurrency always went to the first replica).

``RoundRobinPolicy`` rotates through the candidates: the baseline the prefix-routing benchmark compares against.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from appliance.engine.contract import Replica
from appliance.gateway.routing.filters import BalanceBound
from appliance.gateway.routing.request import Decision, RoutingRequest
from appliance.gateway.routing.scorers import NEUTRAL, PrefixScorer, Score, Scorer, build_scorers
from appliance.gateway.routing.settings import PrefixScorerSettings, RoutingScorerSettings
from appliance.gateway.routing.view import RoutingView

# Every value the "decided_by" metric label can take: bounded by construction.
DECIDERS = ("outstanding", "kv_cache", "queue", "prefix", "cache_room", "tie_kv_cache", "tie_queue",
            "tie_outstanding", "tie_prefix", "tie_cache_room", "index", "single", "round_robin", "balance",
            "tie_balance")
_TOTAL_DIGITS = 9  # totals equal to this many decimals are ties (float sums of the same scores)


class Policy(Protocol):
    name: str
    prefix: PrefixScorer | None

    def observe(self, replicas: Sequence[Replica]) -> None: ...

    def prune(self, live: Collection[str]) -> None:
        """Forget what is kept of replicas not in ``live`` (gone from the fleet)."""
        ...

    def choose(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> Decision: ...


class RoundRobinPolicy:
    name = "round_robin"
    prefix: PrefixScorer | None = None

    def __init__(self) -> None:
        self._turn = 0

    def observe(self, replicas: Sequence[Replica]) -> None:
        return None

    def prune(self, live: Collection[str]) -> None:
        return None

    def choose(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> Decision:
        replica = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(replica.name, 0.0, "round_robin" if len(candidates) > 1 else "single",
                        scored=[r.name for r in candidates])


class WeightedPolicy:
    name = "weighted"

    def __init__(self, weighted: Sequence[tuple[Scorer, float]], tie_breakers: Sequence[Scorer],
                 balance: BalanceBound | None = None) -> None:
        self.weighted = [(s, w) for s, w in weighted if w > 0]
        self.tie_breakers = list(tie_breakers)
        self._all = {s.name: s for s, _ in self.weighted} | {s.name: s for s in self.tie_breakers}
        self.prefix = next((s for s in self._all.values() if isinstance(s, PrefixScorer)), None)
        self.balance = balance if self.prefix is not None else None  # it bounds what affinity does

    def observe(self, replicas: Sequence[Replica]) -> None:
        for scorer in self._all.values():
            scorer.observe(replicas)
        if self.balance is not None:
            self.balance.observe(replicas)

    def prune(self, live: Collection[str]) -> None:
        if self.prefix is not None:
            self.prefix.prune(live)
        if self.balance is not None:
            self.balance.prune()

    def _balanced(self, request: RoutingRequest | None) -> bool:
        """Bounded: requests the prefix scorer can match (a prompt of at least one block); others route as before."""
        return (self.balance is not None and self.prefix is not None and request is not None
                and bool(request.prompt) and bool(request.hashes(self.prefix.block_chars)))

    def choose(self, candidates: Sequence[Replica], view: RoutingView, request: RoutingRequest | None
               ) -> Decision:
        balanced = self._balanced(request)
        held_back: list[tuple[str, str]] = []
        if balanced:
            assert self.balance is not None
            kept = self.balance.within(candidates)
            if len(kept) < len(candidates):
                held_back = _left_out(candidates, kept)
            candidates = kept
        raw = {name: s.scores(candidates, view, request) for name, s in self._all.items()}
        scores = {name: _neutral(values) for name, values in raw.items()}
        totals = [sum(w * scores[s.name][i] for s, w in self.weighted) for i in range(len(candidates))]
        fewer = [-self.balance.taken(r.name) if balanced and self.balance else 0 for r in candidates]
        keys = [(round(totals[i], _TOTAL_DIGITS), *(scores[t.name][i] for t in self.tie_breakers), fewer[i], -i)
                for i in range(len(candidates))]
        order = sorted(range(len(candidates)), key=keys.__getitem__, reverse=True)
        best = order[0]
        replica = candidates[best]
        if len(order) == 1:
            decided = "balance" if held_back else "single"
        else:
            decided = self._decider(keys, scores, best, order[1])
        prefix = scores["prefix"][best] if "prefix" in scores else None
        for scorer in self._all.values():
            scorer.chosen(replica, request)
        if balanced:
            assert self.balance is not None
            self.balance.chosen(replica.name)
        return Decision(replica.name, totals[best], decided, prefix, removed=held_back,
                        scored=[r.name for r in candidates], scores=raw, totals=totals)

    def _decider(self, keys: list[tuple[float, ...]], scores: dict[str, list[float]], best: int, runner_up: int) -> str:
        if keys[best][0] != keys[runner_up][0]:  # the weighted totals differ: the largest weighted difference
            def gain(weighted: tuple[Scorer, float]) -> float:
                scorer, weight = weighted
                return weight * (scores[scorer.name][best] - scores[scorer.name][runner_up])

            return max(self.weighted, key=gain)[0].name
        for position, scorer in enumerate(self.tie_breakers, start=1):
            if keys[best][position] != keys[runner_up][position]:
                return f"tie_{scorer.name}"
        if keys[best][-2] != keys[runner_up][-2]:
            return "tie_balance"
        return "index"


def _left_out(candidates: Sequence[Replica], kept: Sequence[Replica]) -> list[tuple[str, str]]:
    """The candidates the balance bound left out, as the decision shows them."""
    names = {r.name for r in kept}
    return [(r.name, "balance") for r in candidates if r.name not in names]


def _neutral(scores: list[Score]) -> list[float]:
    return [NEUTRAL if s is None else s for s in scores]


def build_policy(settings: RoutingScorerSettings,
                 affinity_scorer: Callable[[PrefixScorerSettings], PrefixScorer] = PrefixScorer) -> Policy:
    if settings.policy == "round_robin":
        return RoundRobinPolicy()
    scorers = build_scorers(settings.prefix, affinity_scorer)
    weights = settings.weights.model_dump()
    return WeightedPolicy([(scorers[name], weights[name]) for name in scorers],
                          [scorers[name] for name in settings.tie_breakers],
                          BalanceBound(settings.prefix.balance_window, settings.prefix.balance_factor))
