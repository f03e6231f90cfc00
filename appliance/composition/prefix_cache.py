"""Precise prefix routing built from the settings: the routing section's ``prefix_cache``, the engine section's
``kv_events`` (where the appliance's own engines publish), the discovery section's (where engines found elsewhere
do), the role and the model (the tokenizer). The gateway builder (``composition.gateway``) asks for it once.

Which replicas publish where:

- the appliance's own engines (roles all and node, no ``discovery.engine_urls``), with ``engine.kv_events`` on: at
  their port + ``engine.kv_events_port_offset`` (replay + ``engine.kv_events_replay_port_offset``), on 127.0.0.1
  for ``local``, at the replica's address for ``network``;
- engines found by discovery or listed in ``discovery.engine_urls``, with ``discovery.kv_events`` on: at their
  address, the same offsets.

Anything else (events off, no tokenizer, the prefix scorer off) leaves the approximate scorer in place, with a
warning when a precise mode was asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from appliance.engine.contract import Replica
from appliance.engine.kv_events import event_ports
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.hook import PromptTokensHook
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.kv_events.metrics import KvEventsCollector
from appliance.gateway.routing.kv_events.scorer import PreciseScorer
from appliance.gateway.routing.kv_events.settings import PrefixCacheMode
from appliance.gateway.routing.kv_events.subscriber import EventEndpoints
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer
from appliance.gateway.routing.scorers import PrefixScorer
from appliance.gateway.routing.settings import PrefixScorerSettings
from appliance.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class PreciseRouting:
    hub: KvEventsHub
    hook: PromptTokensHook
    hasher: BlockHasher
    precise_only: bool
    scorer: PreciseScorer | None = None

    def affinity_scorer(self, prefix: PrefixScorerSettings) -> PrefixScorer:
        """The router's prefix scorer (``Router(affinity_scorer=...)``)."""
        mode: PrefixCacheMode = "precise" if self.precise_only else "precise-with-fallback"
        self.scorer = PreciseScorer(prefix, self.hub, mode, self.hasher)
        return self.scorer

    def register(self, registry: CollectorRegistry) -> None:
        if self.scorer is not None:
            registry.register(KvEventsCollector(self.hub, self.scorer, self.hook))


def build_precise_routing(settings: Settings, replicas: Callable[[], Sequence[Replica]]) -> PreciseRouting | None:
    """None: the approximate scorer stays (the mode, or what precise routing would need is missing)."""
    section = settings.routing.prefix_cache
    if section.mode == "approximate":
        return None
    endpoints = event_endpoints(settings)
    if endpoints is None:
        log.warning("routing.prefix_cache.mode is %s but no engine publishes KV events (engine.kv_events, "
                    "discovery.kv_events): prefix routing stays approximate", section.mode)
        return None
    path = section.tokenizer or settings.model
    try:
        tokenizer = PromptTokenizer(Path(path), section.tokenizer_threads) if path is not None else None
    except FileNotFoundError as exc:
        log.warning("precise prefix routing needs the model's tokenizer (%s): prefix routing stays approximate", exc)
        return None
    if tokenizer is None:
        log.warning("precise prefix routing needs the model's tokenizer (routing.prefix_cache.tokenizer or model): "
                    "prefix routing stays approximate")
        return None
    hub = KvEventsHub(section, endpoints, replicas, tokenizer=tokenizer)
    hasher = BlockHasher(section.hash_seed)
    return PreciseRouting(hub, PromptTokensHook(tokenizer, hub, hasher, section.max_pending_tokenizations), hasher,
                          precise_only=section.mode == "precise")


def event_endpoints(settings: Settings) -> Callable[[Replica], EventEndpoints | None] | None:
    """Where each replica publishes its KV-cache events (None: none does)."""
    engine = settings.engine
    own = settings.role != "gateway" and not settings.discovery.engine_urls
    if (own and engine.kv_events == "off") or (not own and not settings.discovery.kv_events):
        return None
    loopback = own and engine.kv_events == "local"

    def endpoints(replica: Replica) -> EventEndpoints | None:
        url = urlsplit(replica.url)
        host = "127.0.0.1" if loopback else url.hostname
        if host is None or url.port is None:
            return None
        host = f"[{host}]" if ":" in host else host
        events, replay = event_ports(url.port, engine)
        return EventEndpoints(f"tcp://{host}:{events}", f"tcp://{host}:{replay}")

    return endpoints
