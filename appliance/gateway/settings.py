"""The gateway's sections of the settings (``gateway.*``: listen, auth, timeouts, tracing, SLO; ``routing.*``,
``admission.*``, ``intake.*``): owned here, beside the server, router, admission control and intake limits they
configure, and composed into :class:`appliance.settings.Settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from appliance.secret_files import SECRET_PAIRS, resolve_secrets
from appliance.setting_types import CommaList, blank_is_unset, split_commas

SECRET_FIELDS = tuple(name for pair in SECRET_PAIRS for name in (pair.value, pair.file))


class GatewaySettings(BaseModel):
    """The gateway process: where it listens, who may call it, how long a request may take, where its traces go,
    and the latency it aims at. Each key was a top-level one before this section (``port``, ``api_keys`` ...):
    those names keep working in YAML and as ``APPLIANCE_<KEY>`` (appliance.settings.FLAT_ALIASES)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Gateway bind address.")
    port: int = Field(8000, ge=1, le=65535, description="Gateway port.")
    api_keys: CommaList = Field(
        default_factory=list, description="Bearer keys accepted on /v1 (comma-separated in env); empty = open."
    )
    api_keys_file: Path | None = Field(
        None, description="File holding api_keys, one a line (blank lines and # comments ignored); not with api_keys."
    )
    admin_token: str | None = Field(None, description="Bearer token for /admin; unset disables /admin.")
    admin_token_file: Path | None = Field(
        None, description="File holding admin_token (a compose secret, a Secret volume); not with admin_token."
    )
    alerts_token: str | None = Field(
        None, description="Bearer token accepted on /admin/alerts only (Alertmanager's webhook), besides the admin "
        "token; Alertmanager sends it when set, else the admin token."
    )
    alerts_token_file: Path | None = Field(None, description="File holding alerts_token; not with alerts_token.")
    metrics_token: str | None = Field(
        None, description="Read-only bearer token: when set, /metrics and /sd/targets need it (or the admin token) "
        "and Prometheus sends it; unset: /metrics open, /sd/targets as with API keys."
    )
    metrics_token_file: Path | None = Field(None, description="File holding metrics_token; not with metrics_token.")
    # No default here: it is the monitoring config's TTFT threshold, which only the settings that compose this
    # section with the monitoring one can find (appliance.settings resolves it when no source sets it).
    slo_ttft_p95_seconds: float = Field(
        gt=0, description="Time-to-first-token SLO at P95, which admission "
        "control aims at. Default: slos.ttft.threshold_seconds of alerts/config.yaml (0.8 as shipped), the SLO the "
        "alerts page on; set it here only to aim admission elsewhere than the pages."
    )
    drain_timeout_seconds: float = Field(
        120, gt=0, description="On SIGTERM, how long in-flight requests may run before engines stop."
    )
    request_timeout_seconds: float = Field(600, gt=0, description="Upper bound for one upstream request.")
    upstream_idle_timeout_seconds: float = Field(
        60, gt=0, description="Streams: longest silence from the engine (before the headers or between chunks) before "
        "the stream is cut with an error event and its slot freed; non-streaming answers are bounded by "
        "request_timeout_seconds only."
    )
    upstream_connect_timeout_seconds: float = Field(
        5.0, gt=0, description="How long opening a connection to an engine may take; a connection not made in time "
        "is retried on another replica (the engine never saw the request)."
    )
    max_request_bytes: int = Field(1_048_576, ge=1024, description="Largest request body the gateway accepts.")
    event_loop_probe_seconds: float = Field(
        0.1, gt=0, description="How often the gateway measures its event loop's lag (how late a timer fires: how "
        "long every ready callback, first tokens and relayed stream events included, waited for the loop), "
        "observed into appliance_event_loop_lag_seconds."
    )
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint (e.g. http://tempo:4318/v1/traces); unset: only propagate."
    )
    trace_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Fraction of traces recorded when an OTLP endpoint is set, decided by trace id "
        "(a caller's sampled traceparent keeps its trace id but does not force recording)."
    )
    request_records: int = Field(
        1000, ge=0, description="How many of the last requests the gateway keeps a record of (tenant, admission "
        "wait, the routing decision explained, retries, migrations, TTFT, end), in memory, for GET /admin/requests "
        "and `appliance requests`; about 2 KB each. 0 keeps none (the view is off)."
    )

    @field_validator(*(pair.file for pair in SECRET_PAIRS), mode="before")
    @classmethod
    def _empty_file_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @model_validator(mode="after")
    def _secrets_from_files(self) -> GatewaySettings:
        """Each *_file setting fills its secret (appliance.secret_files): read whenever settings are built."""
        for name, value in resolve_secrets({name: getattr(self, name) for name in SECRET_FIELDS}).items():
            setattr(self, name, value)
        return self

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

    eject_consecutive_failures: int = Field(
        3, ge=1, description="Upstream failures in a row (connect errors, 5xx, timeouts) that eject a replica."
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
    metrics_poll_seconds: float = Field(
        1.0, gt=0, description="How often each engine's /metrics is read for KV-cache usage and queue length."
    )
    metrics_stale_seconds: float = Field(5.0, gt=0, description="Engine metrics older than this count as unknown.")
    migration_limit: int = Field(
        1, ge=0, description="How many times one request's broken answer may be continued on another replica "
        "(a stream from the exact token where it broke; a non-streaming answer sent again). 0: off, broken streams "
        "end with an error event."
    )


class AdmissionSettings(BaseModel):
    """SLA-driven admission: a bounded gateway queue in front of an adaptive per-replica concurrency limit."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Off: every request goes straight to a replica (no 429s, no queue).")
    max_queue: int = Field(256, ge=0, description="Requests that may wait in the gateway; beyond it: 429.")
    queue_timeout_seconds: float = Field(
        10.0, gt=0, description="Longest a request waits in the gateway queue before a 429. The default favours "
        "answering late over refusing (batch clients, the CPU demo); for interactive traffic under a strict TTFT "
        "SLO set it below gateway.slo_ttft_p95_seconds (a request that waited longer can no longer make it)."
    )
    initial_limit: int | None = Field(
        None, ge=1, description="Starting concurrency limit per replica; default engine.max_num_seqs."
    )
    min_limit: int = Field(1, ge=1, description="The limit never drops below this.")
    max_limit: int | None = Field(None, ge=1, description="The limit never exceeds this; default engine.max_num_seqs.")
    decrease_factor: float = Field(0.9, gt=0, lt=1, description="Multiplicative cut when TTFT misses the target.")
    target_ttft_fraction: float = Field(
        0.8, gt=0, le=1, description="Per-request TTFT target as a fraction of gateway.slo_ttft_p95_seconds (headroom)."
    )
    slot_drift_seconds: float = Field(
        30.0, gt=0, description="How long the gateway may count more requests in flight at a replica than its "
        "engine reports running + waiting before that is slot drift (metric appliance_slot_drift, alert "
        "ApplianceSlotDrift; a replica full only by a drifted count makes /health/ready 503)."
    )
    fair_share: bool = Field(
        True, description="Order the queue by tenant priority, then fair share by weight (least served goes next), "
        "and bound a tenant's in-flight share of a replica while others want it. Off: one FIFO queue."
    )
    share_window_seconds: float = Field(
        2.0, ge=0, description="How long a tenant keeps its share of a replica after its requests there end: a "
        "client between two requests finds its room still free instead of behind a flood (capacity held idle at "
        "most this long after a tenant leaves). 0: a share lasts only while requests are held or queued."
    )


class IntakeSettings(BaseModel):
    """Hostile input is refused before any work (appliance/gateway/limits.py, appliance/gateway/connections.py):
    the API key is checked before the body is read; these bound what a client may hold before that."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_seconds: float = Field(
        10.0, gt=0, description="A request's line and headers must arrive within this many seconds (from the "
        "connection's start, or a kept-alive connection's next request's first byte); else 408 and close."
    )
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="The whole body must arrive within this many seconds after the headers (a total, "
        "so a body that trickles in a byte at a time is cut too); else 408 and close."
    )
    max_header_bytes: int = Field(
        65536, ge=1024, description="Largest request line plus headers, in bytes; beyond it: 431 and close."
    )
    max_connections: int = Field(
        1024, ge=1, description="Open client connections the gateway serves at once; a request on a connection "
        "beyond it: 503 with Retry-After, and the connection is closed."
    )
    body_budget_bytes: int = Field(
        67_108_864, ge=1024, description="Request body bytes being received at once, all clients together (a "
        "body counts from its Content-Length, or as it arrives, until it has all arrived); a body that does not "
        "fit: 503 with Retry-After. At least max_request_bytes."
    )
