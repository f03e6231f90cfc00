"""The Grafana dashboards, as code: small panel builders and the four dashboards on-call opens.

Dashboards are generated, not hand-edited, so that every panel follows the same conventions (a datasource
variable, ``$__rate_interval``, units and descriptions, heatmaps for histograms) and a reviewer reads a diff of
Python instead of thousands of lines of JSON. ``python -m appliance.monitoring.dashboards --write`` writes
``dashboards/*.json``; ``--check`` exits 1 with a diff when the committed files are stale (CI and the tests run
it). Grafana loads the files through file provisioning (``dashboards/provisioning``), so uids and panel ids are
fixed here: links, bookmarks and ``appliance snapshot`` rely on them.

Panels query raw metrics rather than recording rules: a dashboard must keep working while rule names evolve,
and Grafana's own ``$__rate_interval`` then matches the scrape interval exactly.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.utils import floatToGoString

SCHEMA_VERSION = 39
DATASOURCE_UID = "prometheus"
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "dashboards"

# The SLOs the overview measures are the alert rules' (alerts/config.yaml), so that a panel and the page agree.
ALERTS_CONFIG = Path(__file__).resolve().parents[2] / "alerts" / "config.yaml"


@dataclass(frozen=True)
class Slos:
    """Defaults apply where alerts/config.yaml is absent (an installed package)."""

    ttft_seconds: float = 0.8  # a bucket boundary of appliance_request_ttft_seconds (slo_ttft_p95_seconds)
    ttft_objective: float = 0.95  # P95: 95 % of streamed requests get their first token within ttft_seconds
    availability_objective: float = 0.995
    error_codes: str = "5.."  # status codes that count against availability
    page_burn: float = 14.4  # the fastest burn rate that pages

    @classmethod
    def load(cls, path: Path = ALERTS_CONFIG) -> Slos:
        if not path.exists():
            return cls()
        config = yaml.safe_load(path.read_text()) or {}
        slos = config.get("slos", {})
        factors = [float(b["factor"]) for b in config.get("burn_rates", []) if "factor" in b]
        default = cls()
        return cls(ttft_seconds=float(slos.get("ttft", {}).get("threshold_seconds", default.ttft_seconds)),
                   ttft_objective=float(slos.get("ttft", {}).get("objective", default.ttft_objective)),
                   availability_objective=float(slos.get("availability", {}).get(
                       "objective", default.availability_objective)),
                   error_codes=str(slos.get("availability", {}).get("error_code_regex", default.error_codes)),
                   page_burn=max(factors, default=default.page_burn))


# Selectors: gateway series (job="appliance") and engine series scraped from vLLM (job="vllm").
GW = 'job="appliance"'
GW_REPLICA = 'job="appliance", replica=~"$replica"'
ENGINE = 'job="vllm", replica=~"$replica", model=~"$model"'
RATE = "$__rate_interval"

Panel = dict[str, Any]
Target = dict[str, Any]


# --- targets and panels ------------------------------------------------------------------------------------------


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> Target:
    """One Prometheus query. ``refId`` is filled in by the panel, in order."""
    return {"datasource": DS, "editorMode": "code", "expr": expr, "format": fmt, "instant": instant,
            "legendFormat": legend, "range": not instant}


def _with_refs(targets: Sequence[Target]) -> list[Target]:
    return [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]


def _thresholds(steps: Sequence[tuple[float | None, str]] | None) -> dict[str, Any]:
    steps = steps or [(None, "green")]
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


def _panel(kind: str, pid: int, title: str, targets: Sequence[Target], *, unit: str, description: str, w: int,
           h: int, options: dict[str, Any], defaults: dict[str, Any] | None = None,
           extra: dict[str, Any] | None = None) -> Panel:
    if not description.strip():
        raise ValueError(f"panel {title!r} needs a description")
    return {
        "datasource": DS,
        "description": description,
        "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "id": pid,
        "options": options,
        "targets": _with_refs(targets),
        "title": title,
        "type": kind,
        **(extra or {}),
    }


def timeseries(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 12, h: int = 8,
               min_: float | None = None, max_: float | None = None, stack: bool = False,
               thresholds: Sequence[tuple[float | None, str]] | None = None) -> Panel:
    """Lines over time, legend as a table with mean / max / last (what an incident write-up quotes)."""
    defaults: dict[str, Any] = {
        "color": {"mode": "palette-classic"},
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0, "showPoints": "never",
                   "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if stack else "none"},
                   "thresholdsStyle": {"mode": "dashed" if thresholds else "off"}},
        "thresholds": _thresholds(thresholds),
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    options = {"legend": {"calcs": ["mean", "max", "lastNotNull"], "displayMode": "table", "placement": "bottom",
                          "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return _panel("timeseries", pid, title, targets, unit=unit, description=description, w=w, h=h,
                  options=options, defaults=defaults)


def stat(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 4, h: int = 4,
         thresholds: Sequence[tuple[float | None, str]] | None = None, decimals: int | None = None) -> Panel:
    """The latest value as a big number, coloured by thresholds."""
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "thresholds": _thresholds(thresholds)}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"colorMode": "value", "graphMode": "area", "justifyMode": "auto", "orientation": "auto",
               "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "textMode": "auto"}
    return _panel("stat", pid, title, targets, unit=unit, description=description, w=w, h=h, options=options,
                  defaults=defaults)


def gauge(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 4, h: int = 6,
          min_: float = 0, max_: float = 1, thresholds: Sequence[tuple[float | None, str]] | None = None) -> Panel:
    """A value against its full scale (ratios: 0..1)."""
    defaults = {"color": {"mode": "thresholds"}, "min": min_, "max": max_, "thresholds": _thresholds(thresholds)}
    options = {"orientation": "auto", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "showThresholdLabels": False, "showThresholdMarkers": True}
    return _panel("gauge", pid, title, targets, unit=unit, description=description, w=w, h=h, options=options,
                  defaults=defaults)


def heatmap(pid: int, title: str, histogram: str, selector: str, *, unit: str, description: str, w: int = 12,
            h: int = 8) -> Panel:
    """A Prometheus histogram as Grafana draws it best: bucket rates per ``le``, no re-bucketing in Grafana."""
    expr = f"sum by (le) (rate({histogram}_bucket{{{selector}}}[{RATE}]))"
    options = {
        "calculate": False,
        "cellGap": 1,
        "cellValues": {"unit": "reqps"},
        "color": {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": False, "scale": "exponential",
                  "scheme": "Oranges", "steps": 64},
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": 1e-9},
        "legend": {"show": True},
        "rowsFrame": {"layout": "le"},
        "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": False},
        "yAxis": {"axisPlacement": "left", "reverse": False, "unit": unit},
    }
    defaults = {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                           "scaleDistribution": {"type": "linear"}}}
    return _panel("heatmap", pid, title, [target(expr, "{{le}}", fmt="heatmap")], unit=unit,
                  description=description, w=w, h=h, options=options, defaults=defaults,
                  extra={"maxDataPoints": 60})


def state_timeline(pid: int, title: str, expr: str, legend: str, states: Sequence[tuple[str, str]], *,
                   description: str, w: int = 24, h: int = 6) -> Panel:
    """A coded state per series over time; ``states`` are (name, colour) for the values 1, 2, 3, ..."""
    mapping = {str(i): {"color": color, "index": i - 1, "text": name} for i, (name, color) in enumerate(states, 1)}
    defaults = {"color": {"mode": "thresholds"}, "custom": {"fillOpacity": 80, "lineWidth": 0},
                "mappings": [{"options": mapping, "type": "value"}], "thresholds": _thresholds(None)}
    options = {"alignValue": "left", "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "mergeValues": True, "rowHeight": 0.9, "showValue": "auto",
               "tooltip": {"mode": "single", "sort": "none"}}
    return _panel("state-timeline", pid, title, [target(expr, legend)], unit="none", description=description,
                  w=w, h=h, options=options, defaults=defaults)


def table(pid: int, title: str, expr: str, *, description: str, unit: str = "none", w: int = 12,
          h: int = 8) -> Panel:
    """The current value of each series as rows, labels as columns (an instant query)."""
    options = {"cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "fields": ""}, "showHeader": True}
    hidden = {"Time": True, "__name__": True, "instance": True, "job": True}
    return _panel("table", pid, title, [target(expr, instant=True, fmt="table")], unit=unit,
                  description=description, w=w, h=h, options=options,
                  extra={"transformations": [{"id": "organize", "options": {"excludeByName": hidden}}]})


def percentiles(histogram: str, selector: str, *, by: str = "") -> list[Target]:
    """P50, P95 and P99 of a histogram over ``$__rate_interval``."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [target(f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
                   f"p{round(q * 100)}{suffix}") for q in (0.5, 0.95, 0.99)]


def rate(metric: str, selector: str, *, by: str = "") -> str:
    """``sum [by (...)] (rate(metric{selector}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def increase(metric: str, selector: str, *, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({metric}{{{selector}}}[{RATE}]))"


# --- dashboards --------------------------------------------------------------------------------------------------


def variables() -> list[dict[str, Any]]:
    """``datasource`` (every panel's), then ``replica`` and ``model`` (multi-value, All = ``.*``)."""
    def label_values(name: str, label: str, metric: str) -> dict[str, Any]:
        query = f"label_values({metric}, {label})"
        return {"allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "datasource": DS, "definition": query, "hide": 0, "includeAll": True, "label": name.capitalize(),
                "multi": True, "name": name, "options": [],
                "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1, "type": "query"}

    datasource = {"current": {"selected": False, "text": "Prometheus", "value": DATASOURCE_UID}, "hide": 0,
                  "includeAll": False, "label": "Data source", "multi": False, "name": "datasource", "options": [],
                  "query": "prometheus", "refresh": 1, "regex": "", "skipUrlSync": False, "type": "datasource"}
    return [datasource,
            label_values("replica", "replica", 'appliance_replica_state{job="appliance"}'),
            label_values("model", "model", 'vllm:num_requests_running{job="vllm"}')]


def annotations() -> list[dict[str, Any]]:
    """Grafana's own (alerts, and what the appliance pushes), plus restarts and maintenance actions from
    Prometheus, so they show even where nothing pushed them."""
    builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
               "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}
    restarts = {"datasource": DS, "enable": True,
                "expr": f"{increase('appliance_replica_restarts_total', GW_REPLICA, by='replica')} > 0",
                "hide": False, "iconColor": "red", "name": "Replica restarts", "step": "1m",
                "tagKeys": "replica", "textFormat": "{{replica}} restarted", "titleFormat": "Restart",
                "useValueForTime": False}
    actions = {"datasource": DS, "enable": True,
               "expr": f"{increase('appliance_maintenance_actions_total', GW, by='action, trigger, result')} > 0",
               "hide": False, "iconColor": "yellow", "name": "Maintenance actions", "step": "1m",
               "tagKeys": "action,trigger,result", "textFormat": "{{action}} ({{trigger}}): {{result}}",
               "titleFormat": "Maintenance", "useValueForTime": False}
    return [builtin, restarts, actions]


def layout(panels: Iterable[Panel]) -> list[Panel]:
    """Place panels left to right, wrapping at Grafana's 24 columns."""
    placed, x, y, line_height = [], 0, 0, 0
    for panel in panels:
        grid = panel["gridPos"]
        if x + grid["w"] > 24:
            x, y, line_height = 0, y + line_height, 0
        panel["gridPos"] = {**grid, "x": x, "y": y}
        x += grid["w"]
        line_height = max(line_height, grid["h"])
        placed.append(panel)
    return placed


def dashboard(uid: str, title: str, description: str, panels: Sequence[Panel], tags: Sequence[str]) -> dict[str, Any]:
    return {
        "annotations": {"list": annotations()},
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
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "utc",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def overview(slos: Slos | None = None) -> dict[str, Any]:
    slos = slos or Slos.load()
    requests = "appliance_requests_total"
    ttft = "appliance_request_ttft_seconds"
    total = rate(requests, GW)
    server_errors = GW + f', code=~"{slos.error_codes}"'
    within_slo = GW + f', le="{floatToGoString(slos.ttft_seconds)}"'  # the label exactly as exposed
    errors = f"({rate(requests, server_errors)} or vector(0))"
    attainment = f"{rate(ttft + '_bucket', within_slo)} / {rate(ttft + '_count', GW)}"
    ttft_budget, availability_budget = 1 - slos.ttft_objective, 1 - slos.availability_objective
    ttft_burn = f"(1 - {attainment}) / {ttft_budget:.6g}"
    availability_burn = f"({errors} / {total}) / {availability_budget:.6g}"
    slo = f"{slos.ttft_seconds:g} s"
    burn_steps = [(None, "green"), (1, "orange"), (slos.page_burn, "red")]
    panels = [
        stat(1, "Request rate", target(total), unit="reqps",
             description="Requests per second answered by the gateway, all routes and status codes."),
        stat(2, "Error ratio", target(f"{errors} / {total}"), unit="percentunit", decimals=2,
             thresholds=[(None, "green"), (availability_budget, "orange"), (10 * availability_budget, "red")],
             description=f"Share of requests answered with a status matching {slos.error_codes!r}: the errors of "
                         f"the availability SLO (alerts/config.yaml). 429s are admission control shedding load "
                         f"on purpose and count only when that regex says so."),
        stat(3, "TTFT SLO attainment", target(attainment), unit="percentunit", decimals=1,
             thresholds=[(None, "red"), (slos.ttft_objective, "green")],
             description=f"Fraction of streamed requests whose time to first token (at the gateway) was within "
                         f"{slo}, the SLO bucket. The objective is {slos.ttft_objective:.1%}."),
        stat(4, "TTFT error-budget burn", target(ttft_burn), unit="x", decimals=1, thresholds=burn_steps,
             description=f"How fast the TTFT error budget ({ttft_budget:.1%} of requests) is being spent: 1 = "
                         f"exactly on budget over the SLO period; {slos.page_burn:g} is the fastest burn rate "
                         f"that pages."),
        stat(5, "Availability burn", target(availability_burn), unit="x", decimals=1, thresholds=burn_steps,
             description=f"Error ratio over the availability error budget ({availability_budget:.2%}); 1 = on "
                         f"budget, {slos.page_burn:g} pages."),
        stat(6, "Ready replicas", target(f'sum(appliance_replica_state{{{GW}, state="ready"}})'), unit="none",
             thresholds=[(None, "red"), (1, "green")],
             description="Replicas the gateway routes to. Zero means every request fails (no ready replica)."),
        timeseries(7, "Requests by route and code", target(rate(requests, GW, by="route, code"),
                                                            "{{route}} {{code}}"), unit="reqps", stack=True,
                   description="Request rate by route (completions, chat) and HTTP status, stacked."),
        timeseries(8, "Errors by code", target(rate(requests, GW + ', code!~"2.."', by="code"), "{{code}}"),
                   unit="reqps",
                   description="Non-2xx responses per second by status: 429 = admission control shedding load, "
                               "503 = draining or no ready replica, 502/504 = engine failures, 4xx = client errors."),
        timeseries(9, "TTFT percentiles (gateway)", *percentiles(ttft, GW), unit="s",
                   thresholds=[(None, "green"), (slos.ttft_seconds, "red")],
                   description=f"Time to first token as clients see it, from arrival at the gateway (queue wait "
                               f"included). The dashed line is the {slo} SLO."),
        timeseries(10, "TTFT SLO attainment over time", target(attainment, "attainment"), unit="percentunit",
                   min_=0, max_=1, thresholds=[(None, "red"), (slos.ttft_objective, "green")],
                   description=f"Fraction of requests with TTFT within {slo} per interval; below the dashed "
                               f"{slos.ttft_objective:.1%} line the error budget burns faster than allowed."),
        timeseries(11, "Error-budget burn rate", target(ttft_burn, "TTFT"), target(availability_burn, "availability"),
                   unit="x", thresholds=[(None, "green"), (1, "red")],
                   description="Burn rate of the TTFT and availability error budgets per interval (1 = on "
                               "budget). The alerts use the same ratios over fixed 5m/1h/6h windows."),
        timeseries(12, "ITL percentiles (gateway)", *percentiles("appliance_request_itl_seconds", GW), unit="s",
                   description="Inter-token latency: the gap between consecutive streamed chunks. Rises with "
                               "batch size (decode is bandwidth bound) and with preemptions."),
        timeseries(13, "E2E latency percentiles (gateway)", *percentiles("appliance_request_e2e_seconds", GW),
                   unit="s", description="Arrival at the gateway to the last byte; grows with output length, so "
                                         "compare with TTFT and ITL before blaming the engine."),
        timeseries(14, "Queue wait percentiles (gateway)",
                   *percentiles("appliance_request_queue_wait_seconds", GW), unit="s",
                   description="Time spent in the gateway's admission queue before a replica took the request; "
                               "non-zero means every replica is at its concurrency limit."),
        timeseries(15, "Tokens per second", target(rate("appliance_tokens_total", GW, by="kind"), "{{kind}}"),
                   unit="suffix: tok/s",
                   description="Prompt tokens in and completion tokens out per second, from the engines' usage "
                               "reports as relayed by the gateway."),
        timeseries(16, "Engine TTFT p95 by replica (vLLM)",
                   target(f"histogram_quantile(0.95, sum by (le, replica) "
                          f"(rate(vllm:time_to_first_token_seconds_bucket{{{ENGINE}}}[{RATE}])))", "{{replica}}"),
                   unit="s", description="TTFT measured inside each vLLM engine (no gateway queue); the gap to "
                                         "the gateway's TTFT is queueing, routing and network."),
        heatmap(17, "TTFT distribution", ttft, GW, unit="s",
                description="Requests per second in each TTFT bucket: shows bimodal latency (cold prefill, "
                            "preemption) that percentiles hide."),
        heatmap(18, "ITL distribution", "appliance_request_itl_seconds", GW, unit="s",
                description="Chunk gaps per second in each inter-token-latency bucket."),
        heatmap(19, "E2E latency distribution", "appliance_request_e2e_seconds", GW, unit="s",
                description="Requests per second in each end-to-end latency bucket."),
        heatmap(20, "Queue wait distribution", "appliance_request_queue_wait_seconds", GW, unit="s",
                description="Requests per second in each admission-queue wait bucket."),
    ]
    return dashboard("appliance-overview", "Appliance / Service & SLOs",
                     "Is the service meeting its SLOs? Traffic, errors, latency percentiles and burn rates.",
                     panels, ["slo"])


def capacity() -> dict[str, Any]:
    kv = f"vllm:kv_cache_usage_perc{{{ENGINE}}}"
    panels = [
        stat(1, "Max KV cache occupancy", target(f"max({kv})"), unit="percentunit", decimals=0,
             thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
             description="Highest KV cache usage of any replica; near 100 % vLLM preempts running requests."),
        stat(2, "Gateway queue", target(f"appliance_queue_length{{{GW}}}"), unit="none",
             thresholds=[(None, "green"), (1, "orange"), (20, "red")],
             description="Requests waiting in the gateway's admission queue right now."),
        stat(3, "In flight", target(f"appliance_inflight_requests{{{GW}}}"), unit="none",
             description="Requests the gateway has dispatched to replicas and not yet finished."),
        stat(4, "Engine waiting", target(f"sum(vllm:num_requests_waiting{{{ENGINE}}})"), unit="none",
             thresholds=[(None, "green"), (1, "orange")],
             description="Requests queued inside the vLLM engines (should stay near 0: admission queues at the "
                         "gateway, where it is visible and bounded)."),
        stat(5, "429 rate", target(rate("appliance_admission_rejections_total", GW)), unit="reqps",
             thresholds=[(None, "green"), (0.01, "orange")],
             description="Requests per second rejected by admission control (queue full or queue timeout)."),
        stat(6, "Preemptions", target(rate("vllm:num_preemptions_total", ENGINE)), unit="ops",
             thresholds=[(None, "green"), (0.01, "orange")],
             description="vLLM preemptions per second, all replicas: the KV cache ran out and running requests "
                         "were evicted and will be recomputed."),
        timeseries(7, "KV cache occupancy by replica", target(kv, "{{replica}}"), unit="percentunit", min_=0,
                   max_=1, thresholds=[(None, "green"), (0.9, "red")],
                   description="Fraction of each engine's KV cache blocks in use (vLLM's kv_cache_usage_perc)."),
        timeseries(8, "Queue length: gateway and engines",
                   target(f"appliance_queue_length{{{GW}}}", "gateway"),
                   target(f"sum by (replica) (vllm:num_requests_waiting{{{ENGINE}}})", "engine {{replica}}"),
                   unit="none", description="Gateway admission queue versus each engine's own waiting queue."),
        timeseries(9, "Running vs waiting by replica",
                   target(f"sum by (replica) (vllm:num_requests_running{{{ENGINE}}})", "running {{replica}}"),
                   target(f"sum by (replica) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{replica}}"),
                   unit="none", description="Requests in each engine's running batch and in its waiting queue "
                                            "(continuous batching: running is the batch size)."),
        timeseries(10, "Preemptions by replica",
                   target(rate("vllm:num_preemptions_total", ENGINE, by="replica"), "{{replica}}"), unit="ops",
                   description="Preemptions per second per replica: sustained preemption means the KV cache is "
                               "too small for the admitted concurrency."),
        timeseries(11, "Concurrency limit vs outstanding",
                   target(f"appliance_replica_concurrency_limit{{{GW_REPLICA}}}", "limit {{replica}}"),
                   target(f"appliance_replica_outstanding_requests{{{GW_REPLICA}}}", "outstanding {{replica}}"),
                   unit="none", description="Admission control's adaptive (AIMD) limit per replica and the "
                                            "requests in flight there; outstanding at the limit means queueing."),
        timeseries(12, "Admission rejections by reason",
                   target(rate("appliance_admission_rejections_total", GW, by="reason"), "{{reason}}"),
                   unit="reqps", description="429s per second by reason: the queue was full, or a request "
                                             "waited longer than the queue timeout."),
        timeseries(13, "In flight and queued", target(f"appliance_inflight_requests{{{GW}}}", "in flight"),
                   target(f"appliance_queue_length{{{GW}}}", "queued"), unit="none",
                   description="Requests at the replicas and requests waiting at the gateway."),
        timeseries(14, "Generation throughput by replica",
                   target(rate("vllm:generation_tokens_total", ENGINE, by="replica"), "out {{replica}}"),
                   target(rate("vllm:prompt_tokens_total", ENGINE, by="replica"), "in {{replica}}"),
                   unit="suffix: tok/s", description="Tokens per second each engine generated and prefilled."),
        timeseries(15, "Prefix cache hit ratio", target(
            f"{rate('vllm:prefix_cache_hits_total', ENGINE, by='replica')} / "
            f"{rate('vllm:prefix_cache_queries_total', ENGINE, by='replica')}", "{{replica}}"),
            unit="percentunit", min_=0, max_=1,
            description="Share of prompt tokens served from vLLM's prefix cache (no prefill compute needed)."),
        timeseries(16, "Outlier ejections",
                   target(f"appliance_replica_ejected{{{GW_REPLICA}}}", "ejected {{replica}}"),
                   target(increase("appliance_replica_ejections_total", GW_REPLICA, by="replica"),
                          "ejections {{replica}}"),
                   unit="none", description="1 while the router has ejected a replica for slow or failing "
                                            "responses, and ejections per interval."),
        heatmap(17, "Engine queue time distribution", "vllm:request_queue_time_seconds", ENGINE, unit="s",
                description="Time requests spent in vLLM's waiting queue, per bucket; should stay in the lowest "
                            "buckets because admission control queues at the gateway."),
        heatmap(18, "Engine TTFT distribution", "vllm:time_to_first_token_seconds", ENGINE, unit="s",
                description="Time to first token measured inside the engines, per bucket."),
    ]
    return dashboard("appliance-capacity", "Appliance / Capacity",
                     "Is there headroom? KV cache, queues, batching, preemptions and admission control.",
                     panels, ["capacity"])


def hardware() -> dict[str, Any]:
    panels = [
        gauge(1, "MBU (mean)", target(f"avg(appliance_mbu_ratio{{{GW_REPLICA}}})"), unit="percentunit",
              thresholds=[(None, "blue"), (0.5, "green"), (0.9, "orange")],
              description="Model bandwidth utilisation: bytes read per decode step x steps/s over peak memory "
                          "bandwidth. Decode is bandwidth bound, so this is its efficiency."),
        gauge(2, "MFU (mean)", target(f"avg(appliance_mfu_ratio{{{GW_REPLICA}}})"), unit="percentunit",
              thresholds=[(None, "blue"), (0.4, "green"), (0.8, "orange")],
              description="Model FLOPs utilisation: 2 x parameters x tokens/s over peak FLOP/s (prefill is "
                          "compute bound)."),
        gauge(3, "Host CPU", target(f"appliance_host_cpu_utilization_ratio{{{GW}}}"), unit="percentunit",
              thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
              description="Busy fraction of all host CPU time."),
        gauge(4, "Gateway CPU", target(f"appliance_gateway_cpu_ratio{{{GW}}}"), unit="percentunit",
              thresholds=[(None, "green"), (0.7, "orange"), (0.9, "red")],
              description="The gateway's single event-loop thread; near 100 % the gateway itself is the "
                          "bottleneck."),
        stat(5, "Max GPU temperature", target(f"max(appliance_gpu_temperature_celsius{{{GW}}})"), unit="celsius",
             w=4, h=6, thresholds=[(None, "green"), (80, "orange"), (88, "red")],
             description="Hottest GPU core (NVML); absent on CPU hosts."),
        stat(6, "Host memory available", target(f"appliance_host_memory_available_bytes{{{GW}}}"), unit="bytes",
             w=4, h=6, description="Memory the host can still give to new allocations without swapping."),
        timeseries(7, "Compute utilisation by replica",
                   target(f"appliance_replica_gpu_utilization_ratio{{{GW_REPLICA}}}", "gpu {{replica}}"),
                   target(f"appliance_engine_cpu_utilization_ratio{{{GW_REPLICA}}}", "cpu {{replica}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="Each replica's GPUs (NVML utilisation) or, on CPU hosts, its CPU time over its "
                               "cores."),
        timeseries(8, "GPU utilisation by GPU",
                   target(f"appliance_gpu_utilization_ratio{{{GW}}}", "util gpu{{gpu}}"),
                   target(f"appliance_gpu_sm_activity_ratio{{{GW}}}", "SM active gpu{{gpu}}"),
                   target(f"appliance_gpu_tensor_activity_ratio{{{GW}}}", "tensor gpu{{gpu}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="NVML utilisation (any kernel running) and, where GPM exists, SM and tensor-core "
                               "activity, which show how busy the kernels really keep the chip."),
        timeseries(9, "MBU and MFU by replica", target(f"appliance_mbu_ratio{{{GW_REPLICA}}}", "MBU {{replica}}"),
                   target(f"appliance_mfu_ratio{{{GW_REPLICA}}}", "MFU {{replica}}"), unit="percentunit", min_=0,
                   description="Roofline estimates per replica against the configured or probed peaks."),
        timeseries(10, "Memory bandwidth utilisation",
                   target(f"appliance_gpu_memory_bandwidth_utilization_ratio{{{GW}}}", "NVML gpu{{gpu}}"),
                   target(f"appliance_gpu_dram_bandwidth_utilization_ratio{{{GW}}}", "GPM gpu{{gpu}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="Fraction of time device memory was read or written (NVML) and DRAM bandwidth "
                               "used (GPM)."),
        timeseries(11, "Resident memory by replica",
                   target(f"appliance_engine_resident_memory_bytes{{{GW_REPLICA}}}", "{{replica}}"),
                   target(f"appliance_host_memory_available_bytes{{{GW}}}", "host available"), unit="bytes",
                   description="RSS of each replica's process tree, and what the host has left; steady growth "
                               "under steady load is a leak."),
        timeseries(12, "GPU memory", target(f"appliance_gpu_memory_used_bytes{{{GW}}}", "used gpu{{gpu}}"),
                   target(f"appliance_gpu_memory_total_bytes{{{GW}}}", "total gpu{{gpu}}"),
                   target(f"sum by (replica) (appliance_engine_gpu_memory_bytes{{{GW_REPLICA}}})", "{{replica}}"),
                   unit="bytes", description="Device memory used and installed per GPU, and what each replica's "
                                             "processes hold (vLLM reserves most of it for the KV cache)."),
        timeseries(13, "Allocator: reserved vs allocated",
                   target(f"appliance_engine_allocator_reserved_bytes{{{GW_REPLICA}}}",
                          "reserved {{replica}} {{kind}}"),
                   target(f"appliance_engine_allocator_allocated_bytes{{{GW_REPLICA}}}",
                          "allocated {{replica}} {{kind}}"),
                   target(f"appliance_engine_allocator_free_held_bytes{{{GW_REPLICA}}}",
                          "free held {{replica}} {{kind}}"),
                   unit="bytes", description="Bytes the allocators (PyTorch CUDA cache, glibc arenas) hold, hand "
                                             "out, and keep free; a growing free-held share is fragmentation."),
        timeseries(14, "Memory fragmentation",
                   target(f"appliance_engine_memory_fragmentation_ratio{{{GW_REPLICA}}}", "{{replica}} {{kind}}"),
                   unit="percentunit", min_=0, max_=1, thresholds=[(None, "green"), (0.3, "orange")],
                   description="Free bytes held by the allocators over the bytes they hold; high and rising under "
                               "steady load means a large allocation may fail despite free memory (restart in a "
                               "low-traffic window)."),
        timeseries(15, "Allocation retries and OOMs",
                   target(increase("appliance_engine_allocation_retries_total", GW_REPLICA, by="replica"),
                          "retries {{replica}}"),
                   target(increase("appliance_engine_oom_total", GW_REPLICA, by="replica"), "OOM {{replica}}"),
                   unit="none", description="PyTorch CUDA allocations that flushed the cache and retried, and "
                                            "out-of-memory errors, per interval."),
        timeseries(16, "GPU temperature", target(f"appliance_gpu_temperature_celsius{{{GW}}}", "gpu{{gpu}}"),
                   unit="celsius", thresholds=[(None, "green"), (85, "red")],
                   description="GPU core temperature (NVML); throttling starts in the high 80s on most parts."),
        timeseries(17, "GPU power", target(f"appliance_gpu_power_watts{{{GW}}}", "draw gpu{{gpu}}"),
                   target(f"appliance_gpu_power_limit_watts{{{GW}}}", "limit gpu{{gpu}}"), unit="watt",
                   description="Power draw against the enforced limit; at the limit clocks drop."),
        timeseries(18, "Host CPU vs engine CPU",
                   target(f"appliance_host_cpu_utilization_ratio{{{GW}}}", "host"),
                   target(f"appliance_gateway_cpu_ratio{{{GW}}}", "gateway"),
                   target(f"appliance_engine_process_cpu_ratio{{{GW_REPLICA}}}", "{{replica}} {{process}}"),
                   unit="percentunit", min_=0, max_=1,
                   description="Host busy fraction against each engine process role (api_server, engine_core, "
                               "worker): a saturated api_server or engine_core starves the accelerator."),
        timeseries(19, "CPU pressure",
                   target(f"rate(appliance_host_cpu_pressure_stalled_seconds_total{{{GW}}}[{RATE}])", "PSI some"),
                   target(f'appliance_host_load_per_core{{{GW}, window="1m"}}', "load/core 1m"), unit="percentunit",
                   description="Fraction of time some task waited for a CPU (Linux PSI) and the 1-minute load per "
                               "core (above 1 = tasks queue for CPU)."),
        table(20, "Collector sources", f"appliance_collector_source{{{GW}}} == 1",
              description="Which source each collector read on the latest scrape (nvml, gpm, cpu_time, ...); "
                          "'none' means its metrics are absent, not zero."),
        timeseries(21, "Collector errors and duration",
                   target(increase("appliance_collector_errors_total", GW, by="collector, source"),
                          "errors {{collector}} {{source}}"),
                   target(f"appliance_collector_duration_seconds{{{GW}}}", "duration {{collector}}"), unit="short",
                   description="Failed source reads per interval (a metric went missing, the scrape survived) "
                               "and each collector's share of the /metrics time in seconds."),
    ]
    return dashboard("appliance-hardware", "Appliance / Hardware",
                     "Is the hardware the bottleneck? Compute, bandwidth, memory, fragmentation, thermals, CPU.",
                     panels, ["hardware"])


REPLICA_STATES = (("ready", "green"), ("starting", "blue"), ("unhealthy", "orange"), ("draining", "yellow"),
                  ("backoff", "red"), ("stopping", "purple"), ("stopped", "text"))


def maintenance() -> dict[str, Any]:
    coded = " + ".join(f'{i} * sum by (replica) (appliance_replica_state{{{GW_REPLICA}, state="{name}"}})'
                       for i, (name, _) in enumerate(REPLICA_STATES, 1))
    panels = [
        stat(1, "Ready replicas", target(f'sum(appliance_replica_state{{{GW}, state="ready"}})'), unit="none",
             thresholds=[(None, "red"), (1, "green")], description="Replicas in the ready state."),
        stat(2, "Draining", target(f'sum(appliance_replica_state{{{GW}, state="draining"}})'), unit="none",
             thresholds=[(None, "green"), (1, "yellow")],
             description="Replicas draining: finishing in-flight requests, receiving no new ones."),
        stat(3, "Hung replicas", target(f"sum(appliance_replica_hung{{{GW}}})"), unit="none",
             thresholds=[(None, "green"), (1, "red")],
             description="Replicas whose engine is alive but makes no progress (the maintenance watchdog)."),
        stat(4, "Restarts", target(increase("appliance_replica_restarts_total", GW_REPLICA)),
             unit="none", thresholds=[(None, "green"), (1, "orange"), (3, "red")],
             description="Replica restarts (crash recovery and maintenance) in the latest interval."),
        stat(5, "Last restart", target(f"max(appliance_replica_last_restart_timestamp_seconds{{{GW_REPLICA}}}) * 1000"),
             unit="dateTimeFromNow",
             description="When any selected replica last restarted (absent until one has restarted)."),
        stat(6, "Next maintenance window",
             target(f"min(appliance_maintenance_next_window_timestamp_seconds{{{GW}}}) * 1000"),
             unit="dateTimeFromNow",
             description="Start of the next scheduled low-traffic maintenance window (rolling restarts)."),
        state_timeline(7, "Replica state", coded, "{{replica}}", REPLICA_STATES,
                       description="Each replica's life-cycle state over time: starting until /health answers, "
                                   "ready, unhealthy after failed probes, draining, backoff after a crash."),
        timeseries(8, "Restarts and crashes",
                   target(increase("appliance_replica_restarts_total", GW_REPLICA, by="replica"),
                          "restarts {{replica}}"),
                   target(increase("appliance_replica_crashes_total", GW_REPLICA, by="replica"),
                          "crashes {{replica}}"),
                   target(increase("appliance_replica_starts_total", GW_REPLICA, by="replica"),
                          "starts {{replica}}"),
                   unit="none", description="Engine starts, restarts and unrequested exits per interval; crashes "
                                            "that repeat are a restart loop."),
        timeseries(9, "Model load time", target(f"appliance_replica_model_load_seconds{{{GW_REPLICA}}}",
                                                "{{replica}}"), unit="s",
                   description="Seconds from spawning a replica's engine to its first healthy answer; slow loads "
                               "point at weights on network storage or a cold page cache."),
        timeseries(10, "Time since last restart",
                   target(f"time() - appliance_replica_last_restart_timestamp_seconds{{{GW_REPLICA}}}", "{{replica}}"),
                   unit="s", description="Age of each replica's current engine since its latest restart."),
        timeseries(11, "Drains", target(f'sum by (replica) (appliance_replica_state{{{GW_REPLICA}, state="draining"}})',
                                        "draining {{replica}}"),
                   target(increase("appliance_maintenance_actions_total", GW + ', action=~"drain.*"', by="result"),
                          "drain actions {{result}}"),
                   unit="none", description="1 while a replica drains, and drain actions taken by maintenance "
                                            "per interval; a drain that stays at 1 is stuck."),
        timeseries(12, "Maintenance actions",
                   target(increase("appliance_maintenance_actions_total", GW, by="action, trigger, result"),
                          "{{action}} {{trigger}} {{result}}"),
                   unit="none", description="Drains, restarts and rolling restarts per interval, by trigger "
                                            "(admin, schedule, alert) and result (ok, failed, aborted, dry_run, "
                                            "rate_limited, skipped)."),
        timeseries(13, "Hung flag by replica", target(f"appliance_replica_hung{{{GW_REPLICA}}}", "{{replica}}"),
                   unit="none", min_=0, max_=1,
                   description="1 while a replica is judged hung (requests in flight, no tokens produced)."),
        timeseries(14, "Readiness", target(f'sum(appliance_replica_state{{{GW}, state="ready"}})', "ready"),
                   target(f'count(appliance_replica_state{{{GW}, state="ready"}})', "replicas"),
                   unit="none", description="Ready replicas against configured replicas; the gap is capacity lost "
                                            "to restarts, drains and failures."),
        timeseries(15, "Alerts received by the webhook",
                   target(increase("appliance_alert_webhook_alerts_total", GW, by="alertname, status, action"),
                          "{{alertname}} {{status}} -> {{action}}"),
                   unit="none", description="Alertmanager notifications the appliance's webhook received per "
                                            "interval, and the action it chose (none, duplicate, or the "
                                            "whitelisted maintenance action)."),
    ]
    return dashboard("appliance-maintenance", "Appliance / Maintenance",
                     "What happened to the replicas? Restarts, crashes, drains, state, model load, maintenance.",
                     panels, ["maintenance"])


DASHBOARDS = {"appliance-overview": overview, "appliance-capacity": capacity, "appliance-hardware": hardware,
              "appliance-maintenance": maintenance}


# --- files -------------------------------------------------------------------------------------------------------


def render(board: dict[str, Any]) -> str:
    """The canonical file text: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def generated() -> dict[str, str]:
    """File name -> text for every dashboard."""
    return {f"{uid}.json": render(build()) for uid, build in DASHBOARDS.items()}


def stale(directory: Path) -> list[str]:
    """Unified diffs of every committed file that differs from the generated one (missing files included)."""
    diffs = []
    for name, text in generated().items():
        path = directory / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diffs.append("".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                      f"committed/{name}", f"generated/{name}", n=2)))
    return diffs


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generated().items():
        path = directory / name
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(text)
        temporary.replace(path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.monitoring.dashboards",
                                     description="Generate the Grafana dashboards (dashboards/*.json).")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the JSON files")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when the files are stale")
    parser.add_argument("--dir", type=Path, default=DASHBOARDS_DIR, help=f"default {DASHBOARDS_DIR}")
    args = parser.parse_args(argv)
    if args.write:
        for path in write(args.dir):
            print(path)
        return 0
    diffs = stale(args.dir)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print(f"{len(diffs)} dashboard file(s) stale: run python -m appliance.monitoring.dashboards --write",
              file=sys.stderr)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
