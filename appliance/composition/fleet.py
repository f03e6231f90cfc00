"""The fleets as the settings describe them: the supervisor's replicas (engine section, replica count, device,
model, state folder), their specs (``appliance config --engines``), and the engines found by discovery (discovery
and engine sections). See ``appliance.composition`` for why this is not in ``appliance.engine``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry

from appliance.engine.discovery import DnsFleet
from appliance.engine.replica import ReplicaSpec
from appliance.engine.supervisor import FleetPlan, Supervisor
from appliance.settings import Settings


def fleet_plan(settings: Settings, model: Path, extra_env: Mapping[str, str] | None = None) -> FleetPlan:
    """What the replicas of ``settings`` are built from besides the engine section. ``extra_env`` is what other
    parts need in every engine's environment; the composition root supplies it."""
    assert settings.served_model_name is not None  # Settings' own validator fills it in when unset
    return FleetPlan.place(model, settings.served_model_name, replicas=settings.replicas, device=settings.device,
                           engine=settings.engine, state_dir=settings.state_dir, extra_env=extra_env)


def build_specs(settings: Settings, model: Path, extra_env: Mapping[str, str] | None = None) -> list[ReplicaSpec]:
    """One spec per replica of ``settings`` (``appliance config --engines`` prints them)."""
    return fleet_plan(settings, model, extra_env).specs(settings.engine)


def build_supervisor(settings: Settings, extra_env: Mapping[str, str] | None = None) -> Supervisor:
    """The replicas the appliance runs itself (roles all and node)."""
    if settings.model is None:
        raise ValueError("no model configured: set `model` (or run `appliance up` for the demo model)")
    return Supervisor.from_plan(fleet_plan(settings, settings.model, extra_env), settings.engine)


def build_dns_fleet(settings: Settings, registry: CollectorRegistry | None = None) -> DnsFleet:
    """The engines behind ``discovery.name`` (role gateway): each node runs its engines from the same
    ``engine.base_port`` as this appliance's settings say."""
    return DnsFleet.from_discovery(settings.discovery, settings.engine.base_port, registry)
