"""The appliance's one settings object.

Sources, lowest to highest precedence: defaults, an optional YAML file (``--config``), then environment variables
``APPLIANCE_<KEY>`` (nested engine keys as ``APPLIANCE_ENGINE__<KEY>``). Invalid values fail at start with a
message naming the key, never later at request time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from appliance.collectors.settings import CollectorSettings
from appliance.engine.settings import DiscoverySettings, EngineSettings
from appliance.gateway.settings import AdmissionSettings, IntakeSettings, RoutingSettings
from appliance.gateway.tenants.settings import TenantSettings, check_tenants
from appliance.maintenance.settings import MaintenanceSettings
from appliance.model.shape import (
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

    @model_validator(mode="before")
    @classmethod
    def _slo_from_the_assets_in_use(cls, data: Any) -> Any:
        """slo_ttft_p95_seconds defaults to the TTFT threshold of the alerts/config.yaml this appliance serves: the
        one under monitoring.assets_dir where that folder has one (the images install the package apart from its
        assets, in /opt/appliance), else the source tree's (the field's default; an error naming the file if that
        is missing too)."""
        if not isinstance(data, dict) or data.get("slo_ttft_p95_seconds") is not None:
            return data
        monitoring = data.get("monitoring")
        assets = monitoring.get("assets_dir") if isinstance(monitoring, dict) else getattr(monitoring, "assets_dir",
                                                                                             None)
        config = Path(assets) / "alerts" / "config.yaml" if assets else None
        if config is not None and config.is_file():
            data = {**data, "slo_ttft_p95_seconds": ttft_slo_seconds(config)}
        return data

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
