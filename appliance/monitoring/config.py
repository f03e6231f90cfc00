"""The monitoring config, ``alerts/config.yaml``, loaded once into typed, frozen objects.

Every SLO, threshold, ``for:`` duration, scrape-job selector and the runbook URL pattern of the generated rules
and dashboards lives in that one reviewed file; this module is its only reader. A file that is missing or does
not match the schema below is an error naming the key, never a silent fall-back to built-in defaults: a default
would let the dashboards and the pages quietly measure different things.

What the file cannot know by itself (that the TTFT threshold is a bucket bound of the gateway's histogram) is
checked by its consumer, :func:`appliance.monitoring.rules.validate_config`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from appliance.paths import ALERTS_DIR

CONFIG_PATH = ALERTS_DIR / "config.yaml"

# Prometheus durations as the rules write them: 30s, 5m, 1h30m, 1d.
Duration = Annotated[str, StringConstraints(pattern=r"^(\d+(ms|[smhdwy]))+$")]
# int | float keeps the number as written (16, not 16.0), so the rendered PromQL reads like the YAML.
Number = Annotated[int | float, Field(ge=0)]
Positive = Annotated[int | float, Field(gt=0)]
Objective = Annotated[float, Field(gt=0, lt=1)]


class MonitoringConfigError(ValueError):
    """alerts/config.yaml cannot be used; the message names the file and the key."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class Selectors(_Model):
    """Label matchers of the two scrape jobs: the contract with prometheus.yml (monitoring/prometheus.py)."""

    appliance: str = Field(min_length=1)
    vllm: str = Field(min_length=1)
    replica_owner: str = Field(min_length=1)  # ANDed with ``appliance`` where replicas are counted

    @property
    def owners(self) -> str:
        """The appliance series of the processes that own engines: count each engine replica once."""
        return f"{self.appliance},{self.replica_owner}"


class AvailabilitySlo(_Model):
    objective: Objective
    error_code_regex: str = Field(min_length=1)


class TtftSlo(_Model):
    objective: Objective
    threshold_seconds: Positive


class Slos(_Model):
    min_request_rate: Number
    availability: AvailabilitySlo
    ttft: TtftSlo


class BurnRate(_Model):
    severity: Literal["critical", "warning"]
    long: Duration
    short: Duration
    factor: Positive
    for_: Duration = Field(alias="for")


# --- per-alert knobs: one shape per alert, so a missing or misspelt knob fails here and not in Prometheus --------


class For(_Model):
    for_: Duration = Field(alias="for")


class Threshold(For):
    threshold: Number


class ThresholdWindow(Threshold):
    window: Duration


class Fragmentation(ThresholdWindow):
    rise: Number


class AcceleratorStarved(For):
    feeder_cpu_threshold: Number
    accelerator_threshold: Number
    host_cpu_threshold: Number
    window: Duration


class ReplicaHung(For):
    severity: Literal["critical", "warning"] = "warning"


class RestartLoop(For):
    crashes: Annotated[int, Field(ge=1)]
    window: Duration


class LatencyDrift(For):
    ratio: Positive
    min_seconds: Number


class SlowModelLoad(For):
    threshold_seconds: Positive


class TenantTTFTBurn(For):
    """One tenant's TTFT SLO misses against the fleet's, over one window."""

    factor: Positive  # the tenant's miss ratio must exceed factor x the TTFT budget, the fleet's must not
    window: Duration
    min_request_rate: Number  # the tenant's streamed requests per second: an idle tenant's ratio says little
    severity: Literal["critical", "warning"] = "warning"


class AccountingDrift(For):
    """What tenants were charged for a replica's work against its engine's own counters, over one window."""

    threshold: Positive  # |tenants' increase / engine's increase - 1| above this, for `for`
    window: Duration  # much longer than a request: the requests open at its edges are what remains
    min_token_rate: Number  # the engine's tokens per second of that kind: a nearly idle replica's ratio says little


class KVEventsLost(For):
    """A replica's KV event index not routed on while it serves, or losing its events again and again."""

    window: Duration  # the window the losses are counted over
    losses: Annotated[int, Field(ge=1)]  # losses no replay repaired (each leaves the index unknown a while)


class BatchWindowMissed(For):
    """A batch that will not finish within its completion window at its recent pace, or that expired."""

    horizon_seconds: Positive  # forecast only for batches with less than this left of their window
    window: Duration  # the pace: lines answered over this window; and how long an expiry keeps the alert


class AlertKnobs(_Model):
    """``alerts:`` in the file; field names are the alert names."""

    ApplianceDown: For
    ApplianceAbsent: For
    ApplianceNoReadyReplica: For
    ApplianceReplicaNotReady: For
    ApplianceKVCacheNearFull: ThresholdWindow
    ApplianceQueueBacklog: ThresholdWindow
    ApplianceEventLoopLagging: ThresholdWindow
    ApplianceLoadShedding: Threshold
    AppliancePreemptionStorm: ThresholdWindow
    ApplianceComputeSaturated: ThresholdWindow
    ApplianceBandwidthBound: ThresholdWindow
    ApplianceAcceleratorStarved: AcceleratorStarved
    ApplianceFragmentationRising: Fragmentation
    ApplianceReplicaHung: ReplicaHung
    ApplianceRestartLoop: RestartLoop
    ApplianceReplicaSpawnFailing: ThresholdWindow
    ApplianceDrainStuck: For
    ApplianceSlotDrift: For
    ApplianceLatencyDrift: LatencyDrift
    ApplianceSlowModelLoad: SlowModelLoad
    ApplianceTenantThrottled: ThresholdWindow
    ApplianceTenantTTFTBurn: TenantTTFTBurn
    ApplianceTenantAccountingDrift: AccountingDrift
    ApplianceQuotaStoreUnreachable: For
    ApplianceKVEventsLost: KVEventsLost
    ApplianceBatchWindowMissed: BatchWindowMissed


class MonitoringConfig(_Model):
    """The whole file. Consumers read attributes; nothing here has a default that the file does not state."""

    runbook_url: str
    appliance_url: str = Field(pattern=r"^https?://[^/\s]+(/\S*)?$")
    selectors: Selectors
    inhibit_equal: tuple[str, ...]
    slos: Slos
    burn_rates: tuple[BurnRate, ...] = Field(min_length=1)
    sli_windows: tuple[Duration, ...] = Field(min_length=1)
    alerts: AlertKnobs
    auto_remediated: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> MonitoringConfig:
        if "{alertname}" not in self.runbook_url:
            raise ValueError("runbook_url must contain {alertname}")
        for burn in self.burn_rates:
            missing = sorted({burn.long, burn.short} - set(self.sli_windows))
            if missing:
                raise ValueError(f"burn-rate windows {missing} are not in sli_windows")
        unknown = sorted(set(self.auto_remediated) - set(AlertKnobs.model_fields))
        if unknown:
            raise ValueError(f"auto_remediated names unknown alerts: {unknown}")
        return self

    def runbook(self, alertname: str, *, appliance_url: str | None = None) -> str:
        """The runbook URL of one alert: the one pattern every annotation and dashboard link is built from.
        ``appliance_url`` replaces the file's ``appliance_url`` (a site's public URL of the gateway)."""
        base = (appliance_url or self.appliance_url).rstrip("/")
        return self.runbook_url.replace("{appliance_url}", base).replace("{alertname}", alertname)

    @property
    def page_burn(self) -> float:
        """The fastest burn rate that pages (the largest factor)."""
        return max(burn.factor for burn in self.burn_rates)


def load_config(path: Path = CONFIG_PATH) -> MonitoringConfig:
    """The config in ``path``; MonitoringConfigError when it is missing, not YAML, or not this schema."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MonitoringConfigError(f"monitoring config {path} does not exist (it holds the SLOs, thresholds and "
                                    "selectors of the generated rules and dashboards)") from None
    except OSError as exc:
        raise MonitoringConfigError(f"cannot read monitoring config {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MonitoringConfigError(f"monitoring config {path} is not valid YAML: {' '.join(str(exc).split())}") \
            from None
    return parse_config(data, source=str(path))


def ttft_slo_seconds(path: Path | None = None) -> float:
    """slos.ttft.threshold_seconds: the TTFT SLO the alerts page on. The appliance's gateway.slo_ttft_p95_seconds
    (what admission control aims at) takes its default from here, so the two cannot drift: one owner, read one
    way."""
    path = path or CONFIG_PATH
    try:
        version = path.stat().st_mtime_ns
    except OSError:
        return float(load_config(path).slos.ttft.threshold_seconds)  # raises, naming the file
    return _ttft_threshold(path, version)


@functools.lru_cache(maxsize=8)
def _ttft_threshold(path: Path, version: int) -> float:
    """One read per version of the file: Settings are built often (every reload, every CLI command, tests)."""
    return float(load_config(path).slos.ttft.threshold_seconds)


def parse_config(data: object, *, source: str = "monitoring config") -> MonitoringConfig:
    """A config from its parsed YAML (a mapping), e.g. a variant a test or a deployment derived from the file."""
    if isinstance(data, MonitoringConfig):
        return data
    if not isinstance(data, Mapping):
        raise MonitoringConfigError(f"{source} must be a mapping of keys to values, got {type(data).__name__}")
    try:
        return MonitoringConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(part) for part in error['loc']) or 'config'}: {error['msg']}"
                             for error in exc.errors())
        raise MonitoringConfigError(f"{source}: {problems}") from None
