"""The appliance's one settings object.

Sources, lowest to highest precedence: defaults, an optional YAML file (``--config``), then environment variables
``APPLIANCE_<KEY>`` (nested engine keys as ``APPLIANCE_ENGINE__<KEY>``). Invalid values fail at start with a
message naming the key, never later at request time.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from appliance.collectors.settings import CollectorSettings
from appliance.gateway.tenants.settings import TenantSettings, check_tenants
from appliance.maintenance.settings import MaintenanceSettings
from appliance.model.shape import (
    KvCacheDtype,
    ShapeError,
    kv_cache_dtype_bytes,
    max_model_len_from_config,
    read_config,
)
from appliance.monitoring.config import ttft_slo_seconds
from appliance.monitoring.settings import MonitoringSettings
from appliance.secret_files import SECRET_PAIRS, resolve_secrets

# Without a model, `appliance up` builds and serves the demo model (appliance.model.demo): these are its name and
# context length (its max_position_embeddings).
DEMO_SERVED_MODEL_NAME = "demo"
DEMO_MAX_MODEL_LEN = 1024
SECRET_FIELDS = tuple(name for pair in SECRET_PAIRS for name in (pair.value, pair.file))


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


class EngineSettings(BaseModel):
    """Engine settings, named as vLLM names its own flags (``max_model_len`` is ``--max-model-len``)."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + completion, in tokens. Unset: the model's own limit from its "
        "config.json, as vLLM derives it (1024 with no model: the demo model's)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences batched together per step (continuous batching).")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget per scheduler step; vLLM's default when unset."
    )
    block_size: int | None = Field(None, ge=1, description="Paged KV-cache block size in tokens.")
    kv_cache_space_gib: int = Field(
        1, ge=1, description="CPU hosts: KV-cache space per replica in whole GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU hosts: fraction of device memory vLLM may use (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica.")
    dtype: str = Field("auto", description="Activation dtype (vLLM --dtype).")
    quantization: str | None = Field(
        None, description="vLLM --quantization; unset lets vLLM read it from the checkpoint (compressed-tensors)."
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="vLLM --kv-cache-dtype: auto keeps K/V in the model's dtype; fp8 (= fp8_e4m3) and "
        "fp8_e5m2 halve the KV cache's bytes per token, so the same space holds twice the tokens. Without "
        "k/v scales in the checkpoint vLLM uses scale 1.0."
    )
    shutdown_timeout_seconds: int = Field(
        10, ge=0, description="vLLM --shutdown-timeout: how long an engine finishes requests on SIGTERM."
    )
    start_timeout_seconds: float = Field(
        300, gt=0, description="How long a starting engine may take to answer /health before it counts as failed."
    )
    extra_args: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="More vLLM flags, passed verbatim. In the environment one string split "
        "like a shell command line (APPLIANCE_ENGINE__EXTRA_ARGS='--enforce-eager --seed 1'), or a JSON list."
    )

    @field_validator("extra_args", mode="before")
    @classmethod
    def _split_args(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else shlex.split(text)
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_kv_cache_dtype_in_extra_args(cls, value: list[str]) -> list[str]:
        if any(arg.split("=", 1)[0] == "--kv-cache-dtype" for arg in value):
            raise ValueError("set engine.kv_cache_dtype instead of passing --kv-cache-dtype in extra_args")
        return value


ScorerName = Literal["outstanding", "kv_cache", "queue", "prefix"]


class ScorerWeights(BaseModel):
    """Weight of each scorer in the weighted sum (0 turns a scorer off)."""

    model_config = ConfigDict(extra="forbid")

    outstanding: float = Field(1.0, ge=0, description="Requests the gateway has in flight at the replica (exact).")
    kv_cache: float = Field(0.0, ge=0, description="Engine KV-cache usage (vllm:kv_cache_usage_perc), if fresh.")
    queue: float = Field(0.0, ge=0, description="Engine queue (vllm:num_requests_waiting), if fresh.")
    prefix: float = Field(1.0, ge=0, description="Share of the prompt's prefix recently sent to the replica.")


class PrefixScorerSettings(BaseModel):
    """The approximate prefix-affinity index: chained hashes of fixed-size character blocks of each prompt."""

    model_config = ConfigDict(extra="forbid")

    block_chars: int = Field(64, ge=8, le=65536, description="Characters per hashed prompt block (~16 tokens).")
    index_bytes: int = Field(
        64 * 2**20, ge=2**16, description="Memory budget of the prefix index in bytes; least recently used blocks "
        "are evicted beyond it."
    )
    load_factor: float = Field(
        1.25, ge=1.0, description="Bounded load: affinity yields when the replica would hold more than this "
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


class RoutingScorerSettings(BaseModel):
    """How the router picks among the replicas the filters left: weighted scorers, or round robin."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["weighted", "round_robin"] = Field(
        "weighted", description="weighted: highest weighted score wins; round_robin: rotate (benchmark baseline)."
    )
    weights: ScorerWeights = Field(default_factory=ScorerWeights)
    tie_breakers: Annotated[list[ScorerName], NoDecode] = Field(
        default_factory=lambda: ["kv_cache", "queue"],
        description="Scorers that order equal weighted totals, in turn; then the lower replica index.",
    )
    prefix: PrefixScorerSettings = Field(default_factory=PrefixScorerSettings)

    @field_validator("tie_breakers", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _usable(self) -> RoutingScorerSettings:
        if len(set(self.tie_breakers)) != len(self.tie_breakers):
            raise ValueError("tie_breakers lists a scorer twice")
        if self.policy == "weighted" and not any(self.weights.model_dump().values()):
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
        "SLO set it below slo_ttft_p95_seconds (a request that waited longer can no longer make it)."
    )
    initial_limit: int | None = Field(
        None, ge=1, description="Starting concurrency limit per replica; default engine.max_num_seqs."
    )
    min_limit: int = Field(1, ge=1, description="The limit never drops below this.")
    max_limit: int | None = Field(None, ge=1, description="The limit never exceeds this; default engine.max_num_seqs.")
    decrease_factor: float = Field(0.9, gt=0, lt=1, description="Multiplicative cut when TTFT misses the target.")
    target_ttft_fraction: float = Field(
        0.8, gt=0, le=1, description="Per-request TTFT target as a fraction of slo_ttft_p95_seconds (headroom)."
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


class DiscoverySettings(BaseModel):
    """Gateway role: engines found by DNS (a Kubernetes headless Service), re-resolved on an interval."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None, description="DNS name whose A/AAAA records are the node addresses (e.g. the headless Service "
        "appliance-engines.NAMESPACE.svc.cluster.local); required when role is gateway."
    )
    interval_seconds: float = Field(5.0, gt=0, description="How often the name is resolved again.")
    engines_per_node: int = Field(
        1, ge=1, le=64, description="Engines behind each address, at engine_base_port + i (the node's replicas)."
    )
    nameserver: str | None = Field(
        None, description="host:port of the DNS server to ask (tests, or a resolver other than the system's); "
        "unset: the system resolver (getaddrinfo)."
    )
    resolve_timeout_seconds: float = Field(
        2.0, gt=0, description="One resolution's time limit; a failed resolution keeps the last known engines."
    )

    @field_validator("nameserver")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"nameserver must be host:port, got {value!r}")
        return value


class Settings(BaseSettings):
    """Everything the appliance reads at start. See docs/configuration.md for each key."""

    model_config = SettingsConfigDict(
        env_prefix="APPLIANCE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    model: Path | None = Field(None, description="HF checkpoint directory; `appliance up` builds the demo model.")
    served_model_name: str | None = Field(
        None, min_length=1, description="Model name clients send. Unset: the model path as given, as vLLM does "
        "(`demo` with no model: the demo model)."
    )
    replicas: int = Field(1, ge=1, le=64, description="Engine replicas (processes).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when NVML sees a GPU.")
    host: str = Field("127.0.0.1", description="Gateway bind address.")
    port: int = Field(8000, ge=1, le=65535, description="Gateway port.")
    engine_base_port: int = Field(8100, ge=1, le=65000, description="Replica i listens on this port + i.")
    engine_host: str = Field(
        "127.0.0.1", description="Engines' bind address. Keep loopback unless Prometheus scrapes them from another "
        "network namespace (compose: the appliance's alias on an internal network only Prometheus shares)."
    )
    engine_advertise_host: str | None = Field(
        None, description="Host name /sd/targets gives Prometheus for the engines; default engine_host "
        "(compose: the appliance service's name)."
    )
    engine_log_max_bytes: int = Field(
        50_000_000, ge=1024, description="Each engine's log (state_dir/logs/engine-N.log) rotates at this size."
    )
    engine_log_backups: int = Field(
        3, ge=1, description="Rotated engine logs kept (engine-N.log.1 ...); at least one, or nothing rotates."
    )
    engine_log_stdout: bool = Field(
        False, description="Engine output also on the appliance's stdout, each line prefixed [replica-N] "
        "(compose and the image: true, so that `docker logs` shows it)."
    )
    engine_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Route to these engines (comma-separated URLs) instead of starting any."
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer keys accepted on /v1 (comma-separated in env); empty = open."
    )
    tenants: list[TenantSettings] = Field(
        default_factory=list, description="Teams or services sharing the appliance, each with its own API keys, "
        "quotas, priority and fair-share weight (docs/tenants.md); JSON in APPLIANCE_TENANTS. The flat api_keys "
        "are one more tenant, named default."
    )
    admin_token: str | None = Field(None, description="Bearer token for /admin; unset disables /admin.")
    admin_token_file: Path | None = Field(
        None, description="File holding admin_token (a compose secret, a Secret volume); not with admin_token."
    )
    api_keys_file: Path | None = Field(
        None, description="File holding api_keys, one a line (blank lines and # comments ignored); not with api_keys."
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
    slo_ttft_p95_seconds: float = Field(
        default_factory=ttft_slo_seconds, gt=0, description="Time-to-first-token SLO at P95, which admission "
        "control aims at. Default: slos.ttft.threshold_seconds of alerts/config.yaml (0.8 as shipped), the SLO the "
        "alerts page on; set it here only to aim admission elsewhere than the pages."
    )
    drain_timeout_seconds: float = Field(
        120, gt=0, description="On SIGTERM, how long in-flight requests may run before engines stop."
    )
    state_dir: Path = Field(Path("var"), description="Engine logs and run state live here.")
    request_timeout_seconds: float = Field(600, gt=0, description="Upper bound for one upstream request.")
    upstream_idle_timeout_seconds: float = Field(
        60, gt=0, description="Streams: longest silence from the engine (before the headers or between chunks) before "
        "the stream is cut with an error event and its slot freed; non-streaming answers are bounded by "
        "request_timeout_seconds only."
    )
    max_request_bytes: int = Field(1_048_576, ge=1024, description="Largest request body the gateway accepts.")
    restart_backoff_initial_seconds: float = Field(1.0, gt=0, description="First wait before restarting a crash.")
    restart_backoff_max_seconds: float = Field(60.0, gt=0, description="Cap of the doubling restart backoff.")
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint (e.g. http://tempo:4318/v1/traces); unset: only propagate."
    )
    trace_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Fraction of traces recorded when an OTLP endpoint is set, decided by trace id "
        "(a caller's sampled traceparent keeps its trace id but does not force recording)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log verbosity.")
    role: Literal["all", "node", "gateway"] = Field(
        "all", description="all: gateway and engines in one process (one host). node: this node's engines (a "
        "Kubernetes node pod). gateway: routing only, engines found by `discovery`."
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    collectors: CollectorSettings = Field(default_factory=CollectorSettings)
    maintenance: MaintenanceSettings = Field(default_factory=MaintenanceSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    intake: IntakeSettings = Field(default_factory=IntakeSettings)
    # Where these settings were read from (load_settings sets it; model_copy keeps it): what `appliance reload`
    # reads again. None for settings built in code.
    _source: SettingsSource | None = PrivateAttr(default=None)

    @property
    def source(self) -> SettingsSource | None:
        return self._source

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model_is_unset(cls, value: Any) -> Any:
        """APPLIANCE_MODEL= (compose passes an unset variable as "") means no model, not the current folder."""
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("api_keys", "engine_urls", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("admin_token_file", "api_keys_file", "alerts_token_file", "metrics_token_file", mode="before")
    @classmethod
    def _empty_file_is_unset(cls, value: Any) -> Any:
        """APPLIANCE_ADMIN_TOKEN_FILE= (compose passes an unset variable as "") means no file, not the folder "."."""
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @model_validator(mode="after")
    def _secrets_from_files(self) -> Settings:
        """Each *_file setting fills its secret (appliance.secret_files): read whenever settings are built."""
        for name, value in resolve_secrets({name: getattr(self, name) for name in SECRET_FIELDS}).items():
            setattr(self, name, value)
        return self

    @model_validator(mode="after")
    def _tenants_are_distinct(self) -> Settings:
        check_tenants(self.tenants, self.api_keys)
        return self

    @property
    def all_api_keys(self) -> list[str]:
        """Every key accepted on /v1: the flat api_keys and every tenant's (empty: the API is open)."""
        return [*self.api_keys, *(key for tenant in self.tenants for key in tenant.api_keys)]

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> Settings:
        engine_ports = range(self.engine_base_port, self.engine_base_port + self.replicas)
        if self.port in engine_ports:
            raise ValueError(
                f"port {self.port} collides with engine ports {engine_ports.start}-{engine_ports.stop - 1}"
            )
        if engine_ports.stop - 1 > 65535:
            raise ValueError("engine_base_port + replicas exceeds 65535")
        if self.role == "gateway" and not self.discovery.name:
            raise ValueError("role gateway needs discovery.name (the engines' headless Service name)")
        if self.role == "gateway" and self.engine_urls:
            raise ValueError("role gateway finds engines by discovery; engine_urls is for role all")
        if self.role == "node" and self.maintenance.enabled and not self.maintenance.coordinator_url:
            raise ValueError("role node with maintenance.enabled needs maintenance.coordinator_url: a node sees only "
                             "its own engines, so uncoordinated node pods would restart at the same window start and "
                             "take the fleet below min_ready_replicas. Point it at one gateway process, which grants "
                             "restart leases (e.g. APPLIANCE_MAINTENANCE__COORDINATOR_URL=http://GATEWAY:8000, with "
                             "the admin token; docs/maintenance.md, 'Beyond one host'), or set maintenance.enabled to "
                             "false on node pods")
        return self

    @model_validator(mode="after")
    def _model_defaults(self) -> Settings:
        """The one place served_model_name and engine.max_model_len get their values when unset, so every reader
        (the engines' flags, /v1/models, the gateway's max_tokens check, `appliance config`, reload) sees the
        same concrete ones. With a model: vLLM's own defaults (the model path as given; the model's limit from
        its config.json). Without one (`appliance up` builds the demo model): `demo` and 1024, the demo model's."""
        if self.served_model_name is None:
            self.served_model_name = str(self.model) if self.model is not None else DEMO_SERVED_MODEL_NAME
        if self.engine.max_model_len is None:
            if self.model is None:
                length = DEMO_MAX_MODEL_LEN
            else:
                try:
                    length = max_model_len_from_config(read_config(self.model)[0])
                except ShapeError as exc:
                    raise ValueError(f"engine.max_model_len is unset and the model's own limit cannot be read "
                                     f"({exc}): set engine.max_model_len (APPLIANCE_ENGINE__MAX_MODEL_LEN)") from None
            self.engine = self.engine.model_copy(update={"max_model_len": length})
        return self

    @model_validator(mode="after")
    def _the_body_budget_holds_the_largest_body(self) -> Settings:
        if self.intake.body_budget_bytes < self.max_request_bytes:
            raise ValueError(f"intake.body_budget_bytes ({self.intake.body_budget_bytes}) is below "
                             f"max_request_bytes ({self.max_request_bytes}): no largest body could ever be read")
        return self

    @model_validator(mode="after")
    def _collectors_know_the_kv_dtype(self) -> Settings:
        """An fp8 KV cache stores one byte per element: the roofline's KV bytes per token follow the engine's
        setting (its width from model/shape.py, the one table of dtype widths) unless the operator set
        collectors.kv_cache_dtype_bytes. "auto" leaves it unset: the model's own dtype decides."""
        if self.engine.kv_cache_dtype != "auto" and self.collectors.kv_cache_dtype_bytes is None:
            width = kv_cache_dtype_bytes(self.engine.kv_cache_dtype, model_dtype_bytes=0)
            self.collectors = self.collectors.model_copy(update={"kv_cache_dtype_bytes": width})
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Explicit arguments win over the environment, which wins over the YAML file, then defaults.
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = settings_cls.model_config.get("yaml_file")
        if yaml_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


@dataclass(frozen=True)
class SettingsSource:
    """The configuration file and explicit overrides settings were loaded from; the environment is re-read."""

    config_file: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Settings:
        return load_settings(self.config_file, **self.overrides)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from an optional YAML file and the environment; raise ConfigError on bad input."""
    if config_file is not None:
        _check_yaml(config_file)

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(yaml_file=config_file)

    try:
        loaded = _FileSettings(**overrides) if config_file else Settings(**overrides)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        raise ConfigError(_describe(exc)) from exc
    loaded._source = SettingsSource(config_file, dict(overrides))
    return loaded


def _check_yaml(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of keys to values")


def _describe(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for error in errors():
        key = ".".join(str(part) for part in error.get("loc", ())) or "config"
        lines.append(f"{key}: {error.get('msg')}")
    return "invalid configuration: " + "; ".join(lines)
