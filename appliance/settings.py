"""The appliance's one settings object: a composition of sections, each owned by the package it configures
(``gateway``, ``routing``, ``admission``, ``intake``, ``breaker``: appliance.gateway; ``engine``, ``discovery``:
appliance.engine.settings; ``collectors``, ``maintenance``, ``monitoring``, ``tenants`` and ``quota_store``
(appliance.gateway.tenants), ``batch``: their packages), plus the few keys that say what the appliance serves and
how it runs (model, replicas, device, role, state_dir, log_level).

Sources, lowest to highest precedence: defaults, an optional YAML file (``--config``), then environment variables
``APPLIANCE_<KEY>`` (section keys as ``APPLIANCE_<SECTION>__<KEY>``), then explicit arguments. Invalid values fail
at start with a message naming the key, never later at request time.

The keys that were top-level before the gateway and engine sections existed (``port``, ``api_keys``,
``engine_base_port`` ...) keep working in every source, YAML, ``APPLIANCE_PORT`` and arguments alike: each is an
alias of its place in a section (``FLAT_ALIASES``), moved there source by source, so precedence between sources
holds whichever spelling each uses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from appliance.batch.settings import BatchSettings
from appliance.collectors.settings import CollectorSettings
from appliance.engine.settings import DiscoverySettings, EngineSettings
from appliance.gateway.admission.settings import AdmissionSettings
from appliance.gateway.breaker.settings import BreakerSettings
from appliance.gateway.intake.settings import IntakeSettings
from appliance.gateway.routing.settings import RoutingSettings
from appliance.gateway.settings import GatewaySettings
from appliance.gateway.tenants.settings import QuotaStoreSettings, TenantSettings, check_tenants
from appliance.http.credentials import Credentials
from appliance.maintenance.settings import MaintenanceSettings
from appliance.model.shape import (
    ShapeError,
    kv_cache_dtype_bytes,
    max_model_len_from_config,
    read_config,
)
from appliance.monitoring.config import ttft_slo_seconds
from appliance.monitoring.settings import MonitoringSettings
from appliance.setting_types import blank_is_unset

# Without a model, `appliance up` builds and serves the demo model (appliance.model.demo): these are its name and
# context length (its max_position_embeddings).
DEMO_SERVED_MODEL_NAME = "demo"
DEMO_MAX_MODEL_LEN = 1024
ENV_PREFIX = "APPLIANCE_"

# The keys that were top-level before the gateway and engine sections, each an alias of its place in a section:
# still accepted in YAML, as APPLIANCE_<KEY> and as arguments (docs/configuration.md, "Earlier names").
FLAT_ALIASES: dict[str, tuple[str, str]] = {
    **{key: ("gateway", key) for key in (
        "host", "port", "api_keys", "api_keys_file", "admin_token", "admin_token_file", "alerts_token",
        "alerts_token_file", "metrics_token", "metrics_token_file", "slo_ttft_p95_seconds", "drain_timeout_seconds",
        "request_timeout_seconds", "upstream_idle_timeout_seconds", "max_request_bytes", "otlp_traces_endpoint",
        "trace_sample_ratio")},
    **{f"engine_{key}": ("engine", key) for key in (
        "base_port", "host", "advertise_host", "log_max_bytes", "log_backups", "log_stdout")},
    "restart_backoff_initial_seconds": ("engine", "restart_backoff_initial_seconds"),
    "restart_backoff_max_seconds": ("engine", "restart_backoff_max_seconds"),
    "engine_urls": ("discovery", "engine_urls"),
}


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


def nest_flat_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` (one source's keys) with each earlier top-level key of ``FLAT_ALIASES`` moved into its section. A
    key given both ways in one source is an error: which value was meant cannot be told."""
    out = dict(data)
    for flat, (section, key) in FLAT_ALIASES.items():
        if flat not in out:
            continue
        given = out.get(section)
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        if given is not None and not isinstance(given, Mapping):
            continue  # the section itself is malformed: validation names it
        if key in (given or {}):
            raise ValueError(f"{flat} and {section}.{key} are both set {where}: set {section}.{key} only "
                             f"({flat} is its earlier name)")
        out[section] = {**(given or {}), key: out.pop(flat)}
    return out


class _EarlierEnvNames(PydanticBaseSettingsSource):
    """``APPLIANCE_<KEY>`` for each earlier top-level key (pydantic-settings reads the names of declared fields
    only), as flat keys for :class:`_Sectioned` to move."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the environment itself

    def __call__(self) -> dict[str, Any]:
        env = {name.upper(): value for name, value in os.environ.items()}
        return {flat: env[name] for flat in FLAT_ALIASES if (name := f"{ENV_PREFIX}{flat.upper()}") in env}


class _Sectioned(PydanticBaseSettingsSource):
    """One source of settings (arguments, the environment, the YAML file) with its earlier top-level keys moved into
    their sections before the sources are merged, so each source's precedence holds whichever names it uses."""

    def __init__(self, where: str, *sources: PydanticBaseSettingsSource) -> None:
        super().__init__(sources[0].settings_cls)
        self.where = where
        self.sources = sources
        self.__name__ = type(sources[0]).__name__  # the key pydantic-settings files this source's values under

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ asks the wrapped sources

    def _set_current_state(self, state: dict[str, Any]) -> None:
        super()._set_current_state(state)
        for source in self.sources:
            source._set_current_state(state)

    def __call__(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for source in self.sources:
            for key, value in source().items():
                merged.setdefault(key, value)
        return nest_flat_keys(merged, self.where)


class _SectionedYaml(YamlConfigSettingsSource):
    """The YAML file with its earlier top-level keys moved into their sections (a subclass, not a
    :class:`_Sectioned`, so pydantic-settings still sees the YAML source the ``yaml_file`` setting is for)."""

    def __call__(self) -> dict[str, Any]:
        return nest_flat_keys(super().__call__(), f"in {self.yaml_file_path}")


class _TtftSloDefault(PydanticBaseSettingsSource):
    """The lowest source: ``gateway.slo_ttft_p95_seconds``, where no other source sets it, is the TTFT threshold of
    the alerts/config.yaml this appliance serves, so that admission aims at the SLO the alerts page on.

    The one place that default is resolved: it joins two sections (the gateway's SLO, the monitoring assets' folder),
    so it belongs to the settings that compose them, not to either section. A source rather than a validator: it
    sees what the other sources gave (``monitoring.assets_dir`` included), and a missing or broken config.yaml
    raises its own error naming the file instead of a validation message about the gateway section."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the other sources' merged values

    def __call__(self) -> dict[str, Any]:
        gateway = self.current_state.get("gateway", {})
        if not isinstance(gateway, Mapping) or gateway.get("slo_ttft_p95_seconds") is not None:
            return {}
        config = served_alerts_config(self.current_state.get("monitoring"))
        return {"gateway": {"slo_ttft_p95_seconds": ttft_slo_seconds(config)}}


def served_alerts_config(monitoring: Any) -> Path | None:
    """The alerts/config.yaml under ``monitoring.assets_dir`` (a mapping or a section, as a source gives it) where
    that folder has one: the images install the package apart from its assets, in /opt/appliance. None: the
    source tree's (``ttft_slo_seconds``' own default, an error naming the file if that is missing too)."""
    assets = monitoring.get("assets_dir") if isinstance(monitoring, Mapping) else getattr(monitoring, "assets_dir",
                                                                                            None)
    config = Path(assets) / "alerts" / "config.yaml" if assets else None
    return config if config is not None and config.is_file() else None


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
    tenants: list[TenantSettings] = Field(
        default_factory=list, description="Teams or services sharing the appliance, each with its own API keys, "
        "quotas, priority and fair-share weight (docs/tenants.md); JSON in APPLIANCE_TENANTS. The flat api_keys "
        "are one more tenant, named default."
    )
    state_dir: Path = Field(Path("var"), description="Engine logs and run state live here.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log verbosity.")
    role: Literal["all", "node", "gateway"] = Field(
        "all", description="all: gateway and engines in one process (one host). node: this node's engines (a "
        "Kubernetes node pod). gateway: routing only, engines found by `discovery`."
    )
    gateway: GatewaySettings  # never missing: _TtftSloDefault gives at least its TTFT SLO, which has no default
    engine: EngineSettings = Field(default_factory=EngineSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    collectors: CollectorSettings = Field(default_factory=CollectorSettings)
    maintenance: MaintenanceSettings = Field(default_factory=MaintenanceSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    intake: IntakeSettings = Field(default_factory=IntakeSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    quota_store: QuotaStoreSettings = Field(default_factory=QuotaStoreSettings)
    # Where these settings were read from (load_settings sets it; model_copy keeps it): what `appliance reload`
    # reads again. None for settings built in code.
    _source: SettingsSource | None = PrivateAttr(default=None)

    @property
    def source(self) -> SettingsSource | None:
        return self._source

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @model_validator(mode="after")
    def _tenants_are_distinct(self) -> Settings:
        check_tenants(self.tenants, self.gateway.api_keys)
        return self

    @property
    def all_api_keys(self) -> list[str]:
        """Every key accepted on /v1: the flat api_keys and every tenant's (empty: the API is open)."""
        return [*self.gateway.api_keys, *(key for tenant in self.tenants for key in tenant.api_keys)]

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy, refusing a key that is not a top-level setting: pydantic would keep it as a stray
        attribute that nothing reads (``update={"admin_token": ...}`` after the key moved into ``gateway``). Keys of
        a section go through :meth:`replaced`."""
        unknown = sorted(set(update or {}) - set(type(self).model_fields))
        if unknown:
            raise KeyError(f"not top-level settings: {', '.join(unknown)} (a section's key: replaced({{'section.key': "
                           "value}))")
        return super().model_copy(update=update, deep=deep)

    def value_at(self, key: str) -> Any:
        """The value of a top-level key or of a ``section.key``."""
        section, _, sub = key.partition(".")
        value = getattr(self, section)
        return getattr(value, sub) if sub else value

    def replaced(self, values: Mapping[str, Any]) -> Settings:
        """A copy with each key (top-level or ``section.key``) set to its value, unvalidated: the values come from
        other settings that were (a reload's hot keys, the values ``appliance up`` filled in at start)."""
        top = {key: value for key, value in values.items() if "." not in key}
        sections: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, _, sub = key.partition(".")
            if sub:
                sections.setdefault(section, {})[sub] = value
        for section, subs in sections.items():
            current = getattr(self, section)
            unknown = sorted(set(subs) - set(type(current).model_fields))
            if unknown:
                raise KeyError(f"not keys of {section}: {', '.join(unknown)}")
            top[section] = current.model_copy(update=subs)
        return self.model_copy(update=top)

    @property
    def credentials(self) -> Credentials:
        """The bearer credentials the auth checks read (appliance.http.auth), from these settings."""
        gateway = self.gateway
        return Credentials(tuple(self.all_api_keys), gateway.admin_token, gateway.alerts_token, gateway.metrics_token,
                           gateway.lease_token)

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> Settings:
        engine_ports = range(self.engine.base_port, self.engine.base_port + self.replicas)
        if self.gateway.port in engine_ports:
            raise ValueError(f"gateway.port {self.gateway.port} collides with engine ports "
                             f"{engine_ports.start}-{engine_ports.stop - 1}")
        if engine_ports.stop - 1 > 65535:
            raise ValueError("engine.base_port + replicas exceeds 65535")
        if self.role == "gateway" and not self.discovery.name:
            raise ValueError("role gateway needs discovery.name (the engines' headless Service name)")
        if self.role == "gateway" and self.discovery.engine_urls:
            raise ValueError("role gateway finds engines by discovery.name; discovery.engine_urls is for role all")
        if self.role == "node" and self.maintenance.enabled and not self.maintenance.coordinator_url:
            raise ValueError("role node with maintenance.enabled needs maintenance.coordinator_url: a node sees only "
                             "its own engines, so uncoordinated node pods would restart at the same window start and "
                             "take the fleet below min_ready_replicas. Point it at one gateway process, which grants "
                             "restart leases (e.g. APPLIANCE_MAINTENANCE__COORDINATOR_URL=http://GATEWAY:8000, with "
                             "gateway.lease_token; docs/maintenance.md, 'Beyond one host'), or set maintenance.enabled "
                             "to false on node pods")
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
        if self.intake.body_budget_bytes < self.gateway.max_request_bytes:
            raise ValueError(f"intake.body_budget_bytes ({self.intake.body_budget_bytes}) is below "
                             f"gateway.max_request_bytes ({self.gateway.max_request_bytes}): no largest body could "
                             "ever be read")
        return self

    @model_validator(mode="after")
    def _a_batch_claim_outlasts_a_request(self) -> Settings:
        """A shared batch store hands a line to another gateway when its claim lapses: were the claim shorter than
        a request may last, a line still in flight could be sent twice at once."""
        batch = self.batch
        if batch.database_url is not None and batch.claim_seconds <= self.gateway.request_timeout_seconds:
            raise ValueError(f"batch.claim_seconds ({batch.claim_seconds:g}) must exceed "
                             f"gateway.request_timeout_seconds ({self.gateway.request_timeout_seconds:g})")
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
        sources: list[PydanticBaseSettingsSource] = [
            _Sectioned("as arguments", init_settings),
            _Sectioned("in the environment", env_settings, _EarlierEnvNames(settings_cls)),
        ]
        yaml_file = settings_cls.model_config.get("yaml_file")
        if yaml_file:
            sources.append(_SectionedYaml(settings_cls, yaml_file=yaml_file))
        sources.append(_TtftSloDefault(settings_cls))
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
        raise ConfigError(_describe(exc)) from None  # the cause would carry the input values
    loaded._source = SettingsSource(config_file, dict(overrides))
    return loaded


def _check_yaml(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_error_summary(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read ({type(exc).__name__})") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of keys to values")


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"')


def yaml_error_summary(exc: yaml.YAMLError) -> str:
    """Where and what kind of YAML error, never the text around it: PyYAML's own message quotes the offending line
    (a secret's, as often as not), and this message goes to the CLI, the logs and /admin/reload's answer. The
    problem's wording is kept, with anything it quotes (a character, an alias, a tag) left out."""
    problem = getattr(exc, "problem", None)
    kind = _QUOTED.sub("<omitted>", problem) if isinstance(problem, str) else type(exc).__name__
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is None:
        return kind
    return f"{kind} (line {mark.line + 1}, column {mark.column + 1})"


def _describe(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    earlier = {f"{section}.{key}": flat for flat, (section, key) in FLAT_ALIASES.items()}
    lines = []
    for error in errors():
        key = ".".join(str(part) for part in error.get("loc", ())) or "config"
        if key in earlier:  # the operator may have used the earlier name (APPLIANCE_PORT): name both
            key = f"{key} (earlier name {earlier[key]})"
        lines.append(f"{key}: {error.get('msg')}")
    return "invalid configuration: " + "; ".join(lines)
