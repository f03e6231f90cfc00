"""What every dashboard shares: the selectors from alerts/config.yaml, the variables, the annotations, the layout
in rows, and the dashboard envelope (uid, tags, links, refresh)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.monitoring.config import MonitoringConfig, load_config
from appliance.monitoring.dashboards.panels import DS, Panel, increase, row

SCHEMA_VERSION = 39
DATASOURCE_UID = "prometheus"


def resolve(config: MonitoringConfig | None) -> MonitoringConfig:
    """The given config, or alerts/config.yaml (an error when that file is missing or invalid)."""
    return config if config is not None else load_config()


@dataclass(frozen=True)
class Selectors:
    """Label matchers of the panels, from the scrape-job selectors in alerts/config.yaml plus the variables."""

    gateway: str  # the gateway's series
    gateway_replica: str  # the gateway's per-replica series, filtered by $replica
    engine: str  # vLLM's series (the engines' own /metrics), filtered by $replica and $model
    engine_unfiltered: str  # vLLM's series, every replica and model (variable queries)
    owners: str = ""  # the series of the processes that own engines (replica counts: each engine once)
    owners_replica: str = ""  # the same, filtered by $replica

    @classmethod
    def of(cls, config: MonitoringConfig) -> Selectors:
        gateway, engine = config.selectors.appliance, config.selectors.vllm
        return cls(gateway=gateway, gateway_replica=f'{gateway}, replica=~"$replica"',
                   engine=f'{engine}, replica=~"$replica", model=~"$model"', engine_unfiltered=engine,
                   owners=config.selectors.owners, owners_replica=f'{config.selectors.owners}, replica=~"$replica"')


@dataclass(frozen=True)
class Section:
    """A row and the panels under it."""

    row_id: int
    title: str
    panels: Sequence[Panel]


def label_values(name: str, label: str, metric: str) -> dict[str, Any]:
    """A multi-value query variable listing ``label``'s values on ``metric`` (a selector included), All = ``.*``."""
    query = f"label_values({metric}, {label})"
    return {"allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "datasource": DS, "definition": query, "hide": 0, "includeAll": True, "label": name.capitalize(),
            "multi": True, "name": name, "options": [],
            "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1, "type": "query"}


def variables(sel: Selectors) -> list[dict[str, Any]]:
    """``datasource`` (every panel's), then ``model`` and ``replica`` (multi-value, All = ``.*``). The replica
    list follows the chosen models (a chained variable), so picking a model narrows every dashboard, including
    those that show only the gateway's per-replica series."""
    datasource = {"current": {"selected": False, "text": "Prometheus", "value": DATASOURCE_UID}, "hide": 0,
                  "includeAll": False, "label": "Data source", "multi": False, "name": "datasource", "options": [],
                  "query": "prometheus", "refresh": 1, "regex": "", "skipUrlSync": False, "type": "datasource"}
    engines = f"vllm:num_requests_running{{{sel.engine_unfiltered}}}"
    engines_of_models = f'vllm:num_requests_running{{{sel.engine_unfiltered}, model=~"$model"}}'
    return [datasource, label_values("model", "model", engines), label_values("replica", "replica", engines_of_models)]


def shared_annotations(sel: Selectors) -> list[dict[str, Any]]:
    """Grafana's own (alerts, and what the appliance pushes), plus restarts and maintenance actions from
    Prometheus, so they show even where nothing pushed them."""
    builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
               "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}
    restarts = {"datasource": DS, "enable": True,
                "expr": f"{increase('appliance_replica_restarts_total', sel.gateway_replica, by='replica')} > 0",
                "hide": False, "iconColor": "red", "name": "Replica restarts", "step": "1m",
                "tagKeys": "replica", "textFormat": "{{replica}} restarted", "titleFormat": "Restart",
                "useValueForTime": False}
    actions = {"datasource": DS, "enable": True,
               "expr": f"{increase('appliance_maintenance_actions_total', sel.gateway, by='action, trigger, result')}"
                       " > 0",
               "hide": False, "iconColor": "yellow", "name": "Maintenance actions", "step": "1m",
               "tagKeys": "action,trigger,result", "textFormat": "{{action}} ({{trigger}}): {{result}}",
               "titleFormat": "Maintenance", "useValueForTime": False}
    return [builtin, restarts, actions]


def layout(panels: Iterable[Panel]) -> list[Panel]:
    """Place panels left to right, wrapping at Grafana's 24 columns; a row starts a new line of its own."""
    placed, x, y, line_height = [], 0, 0, 0
    for panel in panels:
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, line_height = 0, y + line_height, 0
        panel["gridPos"] = {**grid, "x": x, "y": y}
        if panel["type"] == "row":
            y += grid["h"]
        else:
            x += grid["w"]
            line_height = max(line_height, grid["h"])
        placed.append(panel)
    return placed


def dashboard(uid: str, title: str, description: str, sections: Sequence[Section], tags: Sequence[str],
              sel: Selectors, extra_variables: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The envelope; ``extra_variables`` follow the shared ones (a dashboard's own, such as ``tenant``)."""
    panels = [panel for section in sections for panel in (row(section.row_id, section.title), *section.panels)]
    return {
        "annotations": {"list": shared_annotations(sel)},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [{"asDropdown": True, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": ["appliance"], "targetBlank": False, "title": "Appliance dashboards", "type": "dashboards"}],
        "liveNow": False,
        "panels": layout(panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["appliance", *tags],
        "templating": {"list": [*variables(sel), *extra_variables]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "utc",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }
