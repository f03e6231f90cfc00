"""Precise prefix routing, read at scrape time: per replica, the events received, applied and lost, the index's
size, staleness and whether it is routed on; which source decided; the prompts tokenized or not."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.gateway.routing.kv_events.hook import PromptTokensHook
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.kv_events.scorer import FALLBACK_REASONS, SOURCES, PreciseScorer

RESET_REASONS = ("restart", "publisher_restart", "all_blocks_cleared", "sync", "replay_gap", "replay_failed",
                 "undecodable", "malformed")
SKIP_REASONS = ("no_index", "unsupported", "loading", "busy", "failed")


class KvEventsCollector(Collector):
    def __init__(self, hub: KvEventsHub, scorer: PreciseScorer, hook: PromptTokensHook | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._hub = hub
        self._scorer = scorer
        self._hook = hook
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        yield from self._replicas()
        decided = CounterMetricFamily("appliance_routing_prefix_source", "Routing decisions by where the chosen "
                                      "replica's prefix score came from: precise (its engine's KV events), "
                                      "approximate (the fallback), none (precise mode, cache unknown).",
                                      labels=["source"])
        for source in SOURCES:
            decided.add_metric([source], self._scorer.sources[source])
        yield decided
        fallbacks = CounterMetricFamily("appliance_routing_precise_fallbacks", "Replica scores that could not be "
                                        "precise: no_tokens (the prompt was not tokenized), unknown_replica (its "
                                        "event index is not current).", labels=["reason"])
        for reason in FALLBACK_REASONS:
            fallbacks.add_metric([reason], self._scorer.fallbacks[reason])
        yield fallbacks
        if self._hook is not None:
            yield from TokenizerCollector(self._hook).collect()

    def _replicas(self) -> Iterable[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "received": CounterMetricFamily("appliance_routing_kv_events_received", "KV-cache events decoded from "
                                            "the replica's engine (live and replayed).", labels=["replica"]),
            "applied": CounterMetricFamily("appliance_routing_kv_events_applied", "KV-cache events about the "
                                           "engine's own cache applied to its index.", labels=["replica"]),
            "lost": CounterMetricFamily("appliance_routing_kv_event_batches_lost", "Event batches missed for good "
                                        "(gaps no replay filled, undecodable batches).", labels=["replica"]),
            "blocks": GaugeMetricFamily("appliance_routing_kv_index_blocks", "Blocks the replica's event index "
                                        "holds.", labels=["replica"]),
            "evicted": CounterMetricFamily("appliance_routing_kv_index_evictions", "Entries dropped to stay within "
                                           "routing.prefix_cache.index_max_blocks.", labels=["replica"]),
            "staleness": GaugeMetricFamily("appliance_routing_kv_index_staleness_seconds", "Seconds since the last "
                                           "event batch was applied (an idle engine sends none: read with "
                                           "appliance_routing_kv_index_usable).", labels=["replica"]),
            "lag": GaugeMetricFamily("appliance_routing_kv_event_lag_seconds", "The last batch's delay from the "
                                     "engine's publish to the index (host clocks).", labels=["replica"]),
            "usable": GaugeMetricFamily("appliance_routing_kv_index_usable", "1 while the replica's event index is "
                                        "in step with its engine and routed on; 0 while unknown (fallback).",
                                        labels=["replica"]),
        }
        resets = CounterMetricFamily("appliance_routing_kv_index_resets", "Times the replica's event index was "
                                     "emptied, by why.", labels=["replica", "reason"])
        now = self._clock()
        for name, index in sorted(self._hub.indexes.items()):
            families["received"].add_metric([name], index.received)
            families["applied"].add_metric([name], index.applied)
            families["lost"].add_metric([name], index.lost_batches)
            families["blocks"].add_metric([name], len(index))
            families["evicted"].add_metric([name], index.evicted)
            if index.last_applied_at is not None:
                families["staleness"].add_metric([name], now - index.last_applied_at)
            if index.last_lag_seconds is not None:
                families["lag"].add_metric([name], index.last_lag_seconds)
            families["usable"].add_metric([name], 1.0 if index.usable(now) else 0.0)
            for reason in RESET_REASONS:
                resets.add_metric([name, reason], index.resets[reason])
        yield from families.values()
        yield resets


class TokenizerCollector(Collector):
    """The request path's tokenizing for precise routing (a gateway worker registers it alone: its decider has the
    indexes and the scorer)."""

    def __init__(self, hook: PromptTokensHook) -> None:
        self._hook = hook

    def collect(self) -> Iterable[Metric]:
        hook = self._hook
        yield CounterMetricFamily("appliance_routing_prompts_tokenized", "Prompts tokenized for precise prefix "
                                  "routing.", value=hook.tokenized)
        yield CounterMetricFamily("appliance_routing_prompt_tokenize_seconds", "Worker time spent tokenizing "
                                  "prompts for routing.", value=hook.seconds)
        yield GaugeMetricFamily("appliance_routing_tokenizer_loaded", "1 once the model's tokenizer has loaded "
                                "for precise prefix routing (in the background from the start; until then prompts "
                                "are routed without their tokens); with gateway workers, summed over the gateway's "
                                "processes.", value=1.0 if hook.tokenizer.loaded.is_set()
                                else 0.0)
        skipped = CounterMetricFamily("appliance_routing_prompts_untokenized", "Requests routed without their "
                                      "tokens, by why: no_index (no replica's event index is current), "
                                      "unsupported (several prompts, embeddings, images), loading (the tokenizer "
                                      "has not loaded yet), busy (max_pending_tokenizations), failed.",
                                      labels=["reason"])
        for reason in SKIP_REASONS:
            skipped.add_metric([reason], hook.skipped[reason])
        yield skipped
