"""The renderer of ``appliance snapshot``: one PNG per panel (matplotlib), ``index.html`` and ``results.json``.

Close enough to Grafana to read an incident, never a second source of truth for what a panel shows.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.monitoring.snapshot.query import PanelResult, Series
from appliance.monitoring.snapshot.timerange import TimeRange


def format_value(value: float, unit: str) -> str:
    """A value the way the panel's unit reads (the common Grafana units; others as plain numbers)."""
    if value is None or math.isnan(value):
        return "no data"
    if unit == "percentunit":
        return f"{value * 100:.3g} %"
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "bytes":
        for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.0f} B"
    if unit in ("dateTimeFromNow", "dateTimeAsIso"):
        return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    suffix = {"reqps": " req/s", "ops": " ops/s", "celsius": " °C", "watt": " W", "x": "×", "none": "",
              "short": ""}.get(unit, "")
    if unit.startswith("suffix:"):
        suffix = " " + unit.split(":", 1)[1].strip()
    return f"{value:.3g}{suffix}"


def _unit_of(panel: Mapping[str, Any]) -> str:
    unit: str
    if panel.get("type") == "heatmap":
        unit = panel.get("options", {}).get("yAxis", {}).get("unit", "")
    else:
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    return unit


def render_panel(result: PanelResult, path: Path, span: TimeRange) -> None:
    """One PNG per panel; a panel without data is an image that says so, not a failure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panel = result.panel
    kind = panel.get("type", "timeseries")
    unit = _unit_of(panel)
    series = [s for s in result.series if s.values]
    figure, axes = plt.subplots(figsize=(8, 3.6) if kind not in ("stat", "gauge") else (4, 2.4), dpi=100)
    axes.set_title(panel.get("title", ""), fontsize=11, loc="left")
    try:
        if result.status != "ok":
            message = "no data" if result.status == "no data" else "query error\n" + "\n".join(result.errors)[:300]
            axes.text(0.5, 0.5, message, ha="center", va="center", fontsize=14 if result.status == "no data" else 8,
                      color="grey", transform=axes.transAxes, wrap=True)
            axes.set_axis_off()
        elif kind in ("stat", "gauge"):
            _draw_stat(axes, series, unit, panel)
        elif kind == "heatmap":
            _draw_heatmap(figure, axes, series, unit, mdates)
        elif kind == "table":
            _draw_table(axes, series, unit)
        else:
            _draw_lines(axes, series, unit, panel, kind, mdates)
            # matplotlib's stubs type limits as floats; at run time its unit converters take datetimes (a date axis).
            axes.set_xlim(_when(span.start), _when(span.end))  # type: ignore[arg-type]
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _draw_stat(axes: Any, series: Sequence[Series], unit: str, panel: Mapping[str, Any]) -> None:
    lasts = [(s.name, next((v for v in reversed(s.values) if not math.isnan(v)), math.nan)) for s in series]
    text = "\n".join(format_value(v, unit) if len(lasts) == 1 else f"{n}: {format_value(v, unit)}"
                     for n, v in lasts[:4])
    axes.text(0.5, 0.45, text, ha="center", va="center", fontsize=26 if len(lasts) == 1 else 12,
              transform=axes.transAxes, color=_threshold_colour(panel, lasts[0][1]))
    axes.set_axis_off()


def _threshold_colour(panel: Mapping[str, Any], value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    colour = "black"
    for step in steps:
        if step.get("value") is None or (not math.isnan(value) and value >= step["value"]):
            colour = {"green": "tab:green", "orange": "tab:orange", "red": "tab:red", "yellow": "goldenrod",
                      "blue": "tab:blue"}.get(step.get("color", ""), "black")
    return colour


def _draw_lines(axes: Any, series: Sequence[Series], unit: str, panel: Mapping[str, Any], kind: str,
                mdates: Any) -> None:
    mappings = {}
    for mapping in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        mappings.update({float(k): v.get("text", k) for k, v in mapping.get("options", {}).items()})
    for s in series[:20]:
        times = [_when(t) for t in s.times]
        if kind == "state-timeline":
            axes.step(times, s.values, where="post", label=s.name)
        else:
            axes.plot(times, s.values, label=s.name, linewidth=1.2)
    if mappings:
        axes.set_yticks(sorted(mappings), [mappings[k] for k in sorted(mappings)])
    else:
        axes.yaxis.set_major_formatter(lambda value, _: format_value(value, unit))
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
    axes.grid(alpha=0.3)
    if series:
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _draw_heatmap(figure: Any, axes: Any, series: Sequence[Series], unit: str, mdates: Any) -> None:
    """Cumulative ``le`` bucket rates -> per-bucket rates, one row per bucket (Grafana's calculate: false)."""
    import numpy as np

    def bound(s: Series) -> float:
        return float(s.labels.get("le", "inf").replace("+Inf", "inf"))

    buckets = sorted((s for s in series if "le" in s.labels), key=bound)
    times = sorted({t for s in buckets for t in s.times})
    index = {t: i for i, t in enumerate(times)}
    cumulative = np.full((len(buckets), len(times)), np.nan)
    for row, s in enumerate(buckets):
        for t, v in zip(s.times, s.values, strict=True):
            cumulative[row, index[t]] = v
    counts = np.diff(np.vstack([np.zeros((1, len(times))), np.nan_to_num(cumulative)]), axis=0).clip(min=0)
    edges = [mdates.date2num(_when(t)) for t in times]
    step = (edges[1] - edges[0]) if len(edges) > 1 else 1 / 1440
    image = axes.imshow(counts, aspect="auto", origin="lower", cmap="Oranges", interpolation="nearest",
                        extent=(edges[0], edges[-1] + step, -0.5, len(buckets) - 0.5))
    labels = [f"≤{format_value(bound(s), unit)}" for s in buckets]
    if buckets and not math.isfinite(bound(buckets[-1])):  # the overflow bucket: above the last finite bound
        labels[-1] = f">{format_value(bound(buckets[-2]), unit)}" if len(buckets) > 1 else "all"
    shown = range(0, len(buckets), max(1, len(buckets) // 10))
    axes.set_yticks(list(shown), [labels[i] for i in shown], fontsize=7)
    axes.xaxis_date()
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
    figure.colorbar(image, ax=axes, label="per second")


def _draw_table(axes: Any, series: Sequence[Series], unit: str) -> None:
    keys = sorted({k for s in series for k in s.labels} - {"__name__", "job", "instance"})
    rows = [[s.labels.get(k, "") for k in keys] + [format_value(s.values[-1], unit)] for s in series[:25]]
    axes.set_axis_off()
    table = axes.table(cellText=rows, colLabels=[*keys, "value"], loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(7)


# --- output ------------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "panel"


def _iso(timestamp: float) -> str:
    return _when(timestamp).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_index(board: Mapping[str, Any], results: Sequence[PanelResult], span: TimeRange, url: str,
                variables: Mapping[str, str]) -> str:
    title = html.escape(board.get("title", board.get("uid", "")))
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{title}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:70em}figure{margin:2em 0}"
        "figcaption{color:#444;max-width:60em}.nodata{color:#888}.error{color:#b00}"
        "h2.row{border-bottom:1px solid #ccc;margin-top:2em}</style></head><body>",
        f"<h1>{title}</h1>",
        f"<p>{html.escape(board.get('description', ''))}</p>",
        f"<p>Time range: <b>{_iso(span.start)}</b> to <b>{_iso(span.end)}</b> (step {span.step:g} s, "
        f"$__rate_interval {html.escape(span.rate_interval)}). Prometheus: {html.escape(url)}. Variables: "
        f"{html.escape(', '.join(f'{k}={v}' for k, v in sorted(variables.items())))}. "
        f'Dashboard uid <code>{html.escape(board.get("uid", ""))}</code>; raw results in '
        '<a href="results.json">results.json</a>.</p>',
    ]
    row = ""
    for result in results:
        if result.row and result.row != row:
            row = result.row
            parts.append(f'<h2 class="row">{html.escape(row)}</h2>')
        panel = result.panel
        status = result.status
        note = {"ok": "", "no data": '<p class="nodata">no data</p>'}.get(
            status, '<p class="error">query error: ' + html.escape("; ".join(result.errors)) + "</p>")
        parts.append(f'<figure id="panel-{panel.get("id")}"><h3>{html.escape(panel.get("title", ""))}</h3>'
                     f'<img src="{html.escape(result.image)}" alt="{html.escape(panel.get("title", ""))}">'
                     f"{note}<figcaption>{html.escape(panel.get('description', ''))}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def results_json(board: Mapping[str, Any], results: Sequence[PanelResult], span: TimeRange, url: str,
                 variables: Mapping[str, str]) -> dict[str, Any]:
    return {
        "dashboard": board.get("uid"), "title": board.get("title"), "prometheus": url,
        "from": span.start, "to": span.end, "step": span.step, "rate_interval": span.rate_interval,
        "variables": dict(variables),
        "panels": [{"id": r.panel.get("id"), "title": r.panel.get("title"), "type": r.panel.get("type"),
                    "row": r.row, "unit": _unit_of(r.panel), "image": r.image, "status": r.status,
                    "targets": r.targets}
                   for r in results],
    }


def write_snapshot(folder: Path, board: Mapping[str, Any], results: Sequence[PanelResult], span: TimeRange,
                   url: str, variables: Mapping[str, str]) -> dict[str, Any]:
    """``panels/*.png``, ``results.json`` and ``index.html`` into ``folder``; returns the results.json document."""
    (folder / "panels").mkdir()
    for result in results:
        result.image = f"panels/{result.panel.get('id')}-{_slug(result.panel.get('title', ''))}.png"
        render_panel(result, folder / result.image, span)
    document = results_json(board, results, span, url, variables)
    (folder / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (folder / "index.html").write_text(write_index(board, results, span, url, variables))
    return document
