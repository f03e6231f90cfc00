"""Panel builders: every panel of every dashboard is made here, so all follow the same conventions.

The conventions: the ``datasource`` variable on every panel and target, ``$__rate_interval`` in every rate, a
unit and a description on every panel, heatmaps for histograms, thresholds without float noise, and a link to
the runbook of every alert a panel shows the signal of. Builders return plain dicts (Grafana's JSON model);
``gridPos`` x/y are filled in by :func:`appliance.monitoring.dashboards.board.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from appliance.monitoring.config import MonitoringConfig

DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

Panel = dict[str, Any]
Target = dict[str, Any]
Link = dict[str, Any]
Steps = Sequence[tuple[float | None, str]]


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> Target:
    """One Prometheus query. ``refId`` is filled in by the panel, in order."""
    return {"datasource": DS, "editorMode": "code", "expr": expr, "format": fmt, "instant": instant,
            "legendFormat": legend, "range": not instant}


def tidy(value: float) -> float:
    """``value`` without binary float noise (1 - 0.995 = 0.0050000000000000044 -> 0.005); ints stay ints."""
    return value if isinstance(value, int) else float(f"{value:.12g}")


def threshold_config(steps: Steps | None) -> dict[str, Any]:
    """Grafana's absolute threshold steps; the first step's value is None (from minus infinity)."""
    steps = steps or [(None, "green")]
    return {"mode": "absolute",
            "steps": [{"color": color, "value": None if value is None else tidy(value)} for value, color in steps]}


def runbooks(config: MonitoringConfig, *alertnames: str) -> list[Link]:
    """Panel links to the runbooks of the alerts whose signal the panel shows (the alert rules' own URLs)."""
    return [{"targetBlank": True, "title": f"Runbook: {name}", "url": config.runbook(name)} for name in alertnames]


def _with_refs(targets: Sequence[Target]) -> list[Target]:
    return [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]


def _panel(kind: str, pid: int, title: str, targets: Sequence[Target], *, unit: str, description: str, w: int,
           h: int, options: dict[str, Any], defaults: dict[str, Any] | None = None,
           extra: dict[str, Any] | None = None, links: Sequence[Link] = ()) -> Panel:
    if not description.strip():
        raise ValueError(f"panel {title!r} needs a description")
    panel = {
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
    if links:
        panel["links"] = list(links)
    return panel


def row(pid: int, title: str) -> Panel:
    """A row header: the panels after it, up to the next row, belong to it (expanded, so every panel stays a
    top-level panel that provisioning, snapshots and tests see)."""
    return {"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "id": pid, "panels": [],
            "title": title, "type": "row"}


def timeseries(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 12, h: int = 8,
               min_: float | None = None, max_: float | None = None, stack: bool = False,
               thresholds: Steps | None = None, links: Sequence[Link] = ()) -> Panel:
    """Lines over time, legend as a table with mean / max / last (what an incident write-up quotes)."""
    defaults: dict[str, Any] = {
        "color": {"mode": "palette-classic"},
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0, "showPoints": "never",
                   "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if stack else "none"},
                   "thresholdsStyle": {"mode": "dashed" if thresholds else "off"}},
        "thresholds": threshold_config(thresholds),
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    options = {"legend": {"calcs": ["mean", "max", "lastNotNull"], "displayMode": "table", "placement": "bottom",
                          "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return _panel("timeseries", pid, title, targets, unit=unit, description=description, w=w, h=h,
                  options=options, defaults=defaults, links=links)


def stat(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 4, h: int = 4,
         thresholds: Steps | None = None, decimals: int | None = None, links: Sequence[Link] = ()) -> Panel:
    """The latest value as a big number, coloured by thresholds."""
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "thresholds": threshold_config(thresholds)}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"colorMode": "value", "graphMode": "area", "justifyMode": "auto", "orientation": "auto",
               "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "textMode": "auto"}
    return _panel("stat", pid, title, targets, unit=unit, description=description, w=w, h=h, options=options,
                  defaults=defaults, links=links)


def gauge(pid: int, title: str, *targets: Target, unit: str, description: str, w: int = 4, h: int = 6,
          min_: float = 0, max_: float = 1, thresholds: Steps | None = None, links: Sequence[Link] = ()) -> Panel:
    """A value against its full scale (ratios: 0..1)."""
    defaults = {"color": {"mode": "thresholds"}, "min": min_, "max": max_, "thresholds": threshold_config(thresholds)}
    options = {"orientation": "auto", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "showThresholdLabels": False, "showThresholdMarkers": True}
    return _panel("gauge", pid, title, targets, unit=unit, description=description, w=w, h=h, options=options,
                  defaults=defaults, links=links)


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
                   description: str, w: int = 24, h: int = 6, links: Sequence[Link] = ()) -> Panel:
    """A coded state per series over time; ``states`` are (name, colour) for the values 1, 2, 3, ..."""
    mapping = {str(i): {"color": color, "index": i - 1, "text": name} for i, (name, color) in enumerate(states, 1)}
    defaults = {"color": {"mode": "thresholds"}, "custom": {"fillOpacity": 80, "lineWidth": 0},
                "mappings": [{"options": mapping, "type": "value"}], "thresholds": threshold_config(None)}
    options = {"alignValue": "left", "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "mergeValues": True, "rowHeight": 0.9, "showValue": "auto",
               "tooltip": {"mode": "single", "sort": "none"}}
    return _panel("state-timeline", pid, title, [target(expr, legend)], unit="none", description=description,
                  w=w, h=h, options=options, defaults=defaults, links=links)


def table(pid: int, title: str, expr: str, *, description: str, unit: str = "none", w: int = 12, h: int = 8,
          hide: Sequence[str] = ()) -> Panel:
    """The current value of each series as rows, labels as columns (an instant query); ``hide`` drops more
    columns (``Value`` for info metrics, whose value is always 1)."""
    options = {"cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "fields": ""}, "showHeader": True}
    hidden = {"Time": True, "__name__": True, "instance": True, "job": True, **{name: True for name in hide}}
    return _panel("table", pid, title, [target(expr, instant=True, fmt="table")], unit=unit,
                  description=description, w=w, h=h, options=options,
                  extra={"transformations": [{"id": "organize", "options": {"excludeByName": hidden}}]})


# --- PromQL shapes the panels repeat ------------------------------------------------------------------------------


def percentiles(histogram: str, selector: str, *, by: str = "",
                quantiles: Sequence[float] = (0.5, 0.95, 0.99)) -> list[Target]:
    """P50, P95 and P99 (or ``quantiles``) of a histogram over ``$__rate_interval``."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [target(f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
                   f"p{round(q * 100)}{suffix}") for q in quantiles]


def rate(metric: str, selector: str, *, by: str = "") -> str:
    """``sum [by (...)] (rate(metric{selector}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def increase(metric: str, selector: str, *, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({metric}{{{selector}}}[{RATE}]))"


def increase_by(metric: str, selector: str, by: str, what: str = "") -> Target:
    """A counter's increase per interval, one series per ``by`` group, its legend ``what`` and then the group's
    labels (``by="replica", what="restarts"``: "restarts {{replica}}")."""
    labels = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return target(increase(metric, selector, by=by), f"{what} {labels}" if what else labels)
