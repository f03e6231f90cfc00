"""The ``routing`` section: filters, scorers and their weights, prefix affinity (and how the engines' prefix caches
are known: ``prefix_cache``), ejection, migration."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from appliance.gateway.routing.kv_events.settings import PrefixCacheSettings
from appliance.setting_types import split_commas

ScorerName = Literal["outstanding", "kv_cache", "queue", "prefix", "cache_room"]


class ScorerWeights(BaseModel):
    """Weight of each scorer in the weighted sum (0 turns a scorer off)."""

    model_config = ConfigDict(extra="forbid")

    outstanding: float = Field(1.0, ge=0, description="Requests the gateway has in flight at the replica (exact).")
    kv_cache: float = Field(0.0, ge=0, description="Engine KV-cache usage (vllm:kv_cache_usage_perc), if fresh.")
    queue: float = Field(0.0, ge=0, description="Engine queue (vllm:num_requests_waiting), if fresh.")
    prefix: float = Field(1.0, ge=0, description="Share of the prompt's prefix recently sent to the replica.")
    cache_room: float = Field(
        2.0, ge=0, description="For a prompt every replica holds equally much of (a new conversation): the free "
        "share of each replica's modelled prefix cache, so it starts where it evicts nothing (a restarted replica) "
        "rather than pushing out conversations that will come back. Needs the prefix scorer."
    )


class PrefixScorerSettings(BaseModel):
    """The approximate prefix-affinity index: chained hashes of fixed-size character blocks of each prompt."""

    model_config = ConfigDict(extra="forbid")

    block_chars: int = Field(64, ge=8, le=65536, description="Characters per hashed prompt block (~16 tokens).")
    index_bytes: int = Field(
        64 * 2**20, ge=2**16, description="Memory budget of the prefix index in bytes; least recently used blocks "
        "are evicted beyond it."
    )
    load_factor: float = Field(
        2.0, ge=1.0, description="Bounded load: affinity yields when the replica would hold more than this "
        "multiple of the mean in-flight requests (rounded up)."
    )
    chars_per_token: float = Field(
        4.0, gt=0, le=64, description="Characters of prompt text per token of the served model's tokenizer: turns "
        "each replica's KV capacity (num_gpu_blocks x block_size tokens) into the index's character blocks."
    )
    balance_window: int = Field(
        128, ge=0, description="Balance bound over the last this many prefix-routed decisions (counted anew when "
        "the set of routable replicas changes): a replica that would exceed balance_factor x its equal share is "
        "left out. 0: off."
    )
    balance_factor: float = Field(
        1.25, ge=1.0, description="The balance bound's multiple of the equal share (rounded up)."
    )


def _default_tie_breakers() -> list[ScorerName]:
    return ["kv_cache", "queue"]


class RoutingScorerSettings(BaseModel):
    """How the router picks among the replicas the filters left: weighted scorers, or round robin."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["weighted", "round_robin"] = Field(
        "weighted", description="weighted: highest weighted score wins; round_robin: rotate (benchmark baseline)."
    )
    weights: ScorerWeights = Field(default_factory=ScorerWeights)
    tie_breakers: Annotated[list[ScorerName], NoDecode] = Field(
        default_factory=_default_tie_breakers,
        description="Scorers that order equal weighted totals, in turn; then the lower replica index.",
    )
    prefix: PrefixScorerSettings = Field(default_factory=PrefixScorerSettings)

    @field_validator("tie_breakers", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        return split_commas(value)

    @model_validator(mode="after")
    def _usable(self) -> RoutingScorerSettings:
        if len(set(self.tie_breakers)) != len(self.tie_breakers):
            raise ValueError("tie_breakers lists a scorer twice")
        deciding = self.weights.model_dump(exclude={"cache_room"})  # it reads the prefix scorer's index
        if self.policy == "weighted" and not any(deciding.values()):
            raise ValueError("every scorer weight is 0: give at least one a positive weight")
        return self


class RoutingSettings(BaseModel):
    """Passive outlier ejection: replicas that fail or lag are taken out of routing for a backoff period."""

    model_config = ConfigDict(extra="forbid")

    scorers: RoutingScorerSettings = Field(default_factory=RoutingScorerSettings)
    prefix_cache: PrefixCacheSettings = Field(default_factory=PrefixCacheSettings)

    eject_consecutive_failures: int = Field(
        3, ge=1, description="Upstream failures in a row (connect errors, 5xx, timeouts) that eject a replica. An "
        "error answer the request's input caused (judged by the breaker section), a 4xx and a long prefill do not "
        "count."
    )
    eject_base_seconds: float = Field(5.0, gt=0, description="First ejection period; doubles per re-ejection.")
    eject_max_seconds: float = Field(120.0, gt=0, description="Cap of the ejection period.")
    eject_decay_seconds: float = Field(
        300.0, gt=0, description="Each full period a replica stays in rotation after an ejection halves the "
        "doubling of its next ejection period (back to eject_base_seconds after a long good spell)."
    )
    eject_panic_threshold: float = Field(
        0.5, ge=0, le=1, description="Panic threshold (as Envoy's): when fewer than this fraction of the routable "
        "replicas would remain un-ejected, or none would, ejection is ignored and all of them take traffic."
    )
    latency_outlier_factor: float = Field(
        3.0, gt=1, description="Eject a replica whose TTFT average exceeds this multiple of its peers' median."
    )
    latency_outlier_min_seconds: float = Field(
        0.5, ge=0, description="...and exceeds the peers' median by at least this much (ignores tiny values)."
    )
    latency_outlier_window_seconds: float = Field(
        30.0, gt=0, description="A replica's TTFT average counts (its own, and as a peer's) only while its last "
        "sample is this recent: a replica that served nothing for longer may have restarted since, and its old "
        "reading would make the replica that carried the load meanwhile look like an outlier."
    )
    metrics_poll_seconds: float = Field(
        1.0, gt=0, description="How often each engine's /metrics is read for KV-cache usage and queue length."
    )
    metrics_stale_seconds: float = Field(5.0, gt=0, description="Engine metrics older than this count as unknown.")
    migration_limit: int = Field(
        1, ge=0, description="How many times one request's broken answer may be continued on another replica "
        "(a stream from the exact token where it broke; a non-streaming answer sent again). 0: off, broken streams "
        "end with an error event."
    )
