"""The gateway process's section of the settings (``gateway.*``: listen, auth, timeouts, tracing, SLO, request
records). The data path's other sections live beside what they configure: ``routing/settings.py``,
``admission/settings.py``, ``intake/settings.py``, ``tenants/settings.py``; :class:`appliance.settings.Settings`
composes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.secret_files import SECRET_PAIRS, resolve_secrets
from appliance.setting_types import CommaList, blank_is_unset

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
    lease_token: str | None = Field(
        None, description="Bearer token accepted on /maintenance/lease only (a node pod's restart lease), besides "
        "the admin token; a node sends it to maintenance.coordinator_url when set, else the admin token."
    )
    lease_token_file: Path | None = Field(None, description="File holding lease_token; not with lease_token.")
    engine_key: str | None = Field(
        None, description="The key engines require (vLLM's VLLM_API_KEY) and the gateway sends them (Authorization: "
        "Bearer); nobody else gets an answer from an engine except /health and /metrics. Unset: generated at start "
        "for the engines this appliance runs; gateway and node pods must share one (engine_key_file)."
    )
    engine_key_file: Path | None = Field(None, description="File holding engine_key; not with engine_key.")
    secret_overlap_seconds: float = Field(
        300, ge=0, description="After `appliance reload` replaces the admin, alerts or metrics token or an API key, "
        "the previous value stays accepted this long, so its holders can move to the new one; then it is refused. "
        "0: refused at once. A removed tenant's keys are revoked at once, whatever this says."
    )
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
    workers: int = Field(
        1, ge=1, le=64, description="Processes that serve the clients' requests. 1: the gateway is one process (the "
        "CPU demo: its engines need the cores). Above 1: that many workers accept the clients' connections and relay "
        "their streams, each on its own core, and the appliance's own process decides for all of them (admission, "
        "routing, tenants' quotas and fair share stay one for the whole gateway; docs/architecture.md, 'Using more "
        "than one core'; with precise prefix routing, each worker tokenizes its own requests' prompts). Takes a "
        "restart."
    )
    request_records: int = Field(
        1000, ge=0, description="How many of the last requests the gateway keeps a record of (tenant, admission "
        "wait, the routing decision explained, retries, migrations, TTFT, end), in memory, for GET /admin/requests "
        "and `appliance requests`; about 2 KB each. 0 keeps none (the view is off)."
    )
    unseen_hold_seconds: float = Field(
        30.0, ge=0, le=3600, description="How long the estimate of work no engine reported (a non-streaming answer "
        "whose client left or timed out, a stream's unread tail) waits for its replica to come to rest, to be "
        "charged to its tenant as the engine's own counters say instead (docs/tenants.md, 'Work no engine "
        "reported'). A tenant's token counters lag such work by at most this long (ten times as long while its "
        "replica does not answer the poll: its engine restarting); quotas and fair share take the estimate at "
        "once. 0: charged as estimated at once."
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
