"""One alerting rule and how an alert is built from its knobs in alerts/config.yaml: the shape every alert module
of this package shares (``rules.py`` renders them all)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from appliance.monitoring.config import MonitoringConfig


@dataclass(frozen=True)
class Alert:
    """One alerting rule; several rules may share a name (the burn-rate windows)."""

    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str = "0m"
    labels: Mapping[str, str] = field(default_factory=dict)


def fill(text: str, **params: object) -> str:
    """Replace ``{name}`` placeholders, leaving Go template actions (``{{ $labels.x }}``) alone."""
    return re.sub(r"\{(\w+)\}", lambda m: str(params[m.group(1)]) if m.group(1) in params else m.group(0), text)


# How the per-replica cause alerts group their series: one alert per replica of each gateway or node.
BY_REPLICA = "job, instance, replica"


def alert(config: MonitoringConfig, name: str, expr: str, summary: str, description: str,
          severity: str = "warning", **values: object) -> Alert:
    """The alert ``name`` with its knobs from alerts/config.yaml: its ``for:``, its severity where the knob has one
    (else ``severity``), and every knob value (``{threshold}``, ``{window}``, ``{for_}``, ...) filled into the
    expression, summary and description, along with the selectors ``{app}`` and ``{vllm}``, the grouping
    ``{by}`` (:data:`BY_REPLICA`) and ``values`` (numbers the caller formats itself). A selector's own braces
    enclose its placeholder: ``up{{app}}`` is ``up{job="appliance"}``."""
    knob = getattr(config.alerts, name)
    params = {"app": config.selectors.appliance, "vllm": config.selectors.vllm, "by": BY_REPLICA,
              **knob.model_dump(), **values}
    return Alert(name, fill(expr, **params), getattr(knob, "severity", severity), for_=knob.for_,
                 summary=fill(summary, **params), description=fill(description, **params))
