"""``appliance snapshot``: a dashboard's panels rendered from Prometheus data to PNG files and one HTML page.

Incidents need pictures that outlive Prometheus' retention and can be attached to a ticket, and hosts without
Grafana (the embedded default, CI) still need to see the dashboards. This reads the same dashboard JSON that
Grafana provisions, runs each panel's queries against Prometheus with Grafana's variables substituted the way
Grafana would, and draws each panel with matplotlib: close enough to read the incident, never a second source
of truth for what a panel shows.

Output (``--out DIR``): ``index.html`` (title, time range, every panel image with its description),
``results.json`` (the raw Prometheus results per target) and ``panels/*.png``. It is written to a temporary
folder beside DIR and renamed into place, so DIR is either absent, the previous snapshot, or this one complete.
Exit codes: 0 written, 1 written but some queries failed, 2 usage error (unknown dashboard, bad time range,
unreachable Prometheus, DIR not empty) with nothing written.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from appliance.monitoring.dashboards import DASHBOARDS, DASHBOARDS_DIR
from appliance.monitoring.promql import substitute

EXIT_OK, EXIT_QUERY_FAILED, EXIT_USAGE = 0, 1, 2
MAX_POINTS = 11_000  # Prometheus refuses range queries with more points per series
DEFAULT_POINTS = 240  # default resolution: about one point per 2 px of a panel image


class SnapshotError(Exception):
    """A problem the user can fix (exit 2); raised before anything is written."""


# --- time range --------------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90s``, ``5m``, ``1h30m``, or plain seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise SnapshotError(f"bad duration {text!r} (e.g. 30s, 5m, 1h30m)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_time(text: str, now: float) -> float:
    """``now``, ``now-1h``, ``-1h`` (relative to now), Unix seconds, or ISO 8601 (UTC unless it says)."""
    text = text.strip()
    if text == "now":
        return now
    relative = re.fullmatch(r"(?:now)?\s*([-+])\s*(\S+)", text)
    if relative and not re.fullmatch(r"[-+]?\d+(?:\.\d+)?", text):
        sign = -1 if relative.group(1) == "-" else 1
        return now + sign * parse_duration(relative.group(2))
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SnapshotError(f"bad time {text!r} (now, now-1h, -30m, Unix seconds or ISO 8601)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


@dataclass(frozen=True)
class TimeRange:
    start: float
    end: float
    step: float
    rate_interval: str

    @classmethod
    def resolve(cls, start: str, end: str, *, step: str | None, rate_interval: str | None,
                scrape_interval: float, now: float) -> TimeRange:
        """Grafana's rules: ``$__rate_interval`` = max(step + scrape interval, 4 x scrape interval)."""
        first, last = parse_time(start, now), parse_time(end, now)
        if not first < last:
            raise SnapshotError(f"empty time range: --from {start} is not before --to {end}")
        span = last - first
        resolution = parse_duration(step) if step else max(scrape_interval, math.ceil(span / DEFAULT_POINTS))
        if resolution <= 0:
            raise SnapshotError("--step must be positive")
        if span / resolution > MAX_POINTS:
            raise SnapshotError(f"--step {resolution:g}s gives {span / resolution:.0f} points per series; "
                                f"Prometheus allows {MAX_POINTS}: use a larger step")
        if rate_interval:
            parse_duration(rate_interval)
            window = rate_interval
        else:
            window = f"{math.ceil(max(resolution + scrape_interval, 4 * scrape_interval))}s"
        return cls(first, last, resolution, window)


# --- dashboards --------------------------------------------------------------------------------------------------


def load_dashboard(uid: str, directory: Path | None) -> dict[str, Any]:
    """The dashboard JSON from ``directory`` (a file named after the uid, or any file with that uid); the
    generated one when the folder does not have it (an installed package has no dashboards/ folder)."""
    folder = directory or DASHBOARDS_DIR
    candidates = [folder / f"{uid}.json"] + sorted(folder.glob("*.json")) if folder.is_dir() else []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            board = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        if isinstance(board, dict) and board.get("uid") == uid:
            return board
    if directory is None and uid in DASHBOARDS:
        return DASHBOARDS[uid]()
    known = sorted({*DASHBOARDS, *(_uid_of(p) for p in candidates if p.is_file())} - {None})
    raise SnapshotError(f"unknown dashboard {uid!r}; known: {', '.join(known)}")


def _uid_of(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("uid")
    except (OSError, ValueError, AttributeError):
        return None


# --- Prometheus --------------------------------------------------------------------------------------------------


class Prometheus:
    """The two query endpoints, with errors as data: one failing panel must not cost the others."""

    def __init__(self, url: str, *, timeout: float) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def check(self) -> None:
        try:
            response = self._client.get("/api/v1/status/buildinfo")
        except httpx.HTTPError as exc:
            raise SnapshotError(f"cannot reach Prometheus at {self.url}: {exc}") from None
        if response.status_code != 200:
            raise SnapshotError(f"{self.url} does not answer like Prometheus (buildinfo: HTTP "
                                f"{response.status_code})")

    def query(self, expr: str, span: TimeRange, *, instant: bool) -> dict[str, Any]:
        """``{"resultType", "result"}`` or ``{"error"}``."""
        if instant:
            path, form = "/api/v1/query", {"query": expr, "time": f"{span.end:.3f}"}
        else:
            path, form = "/api/v1/query_range", {"query": expr, "start": f"{span.start:.3f}",
                                                 "end": f"{span.end:.3f}", "step": f"{span.step:g}"}
        try:
            response = self._client.post(path, data=form)
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        if body.get("status") != "success":
            return {"error": f"{body.get('errorType', 'error')}: {body.get('error', response.text[:200])}"}
        return {"resultType": body["data"]["resultType"], "result": body["data"]["result"]}


# --- panel data --------------------------------------------------------------------------------------------------


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]


@dataclass
class PanelResult:
    panel: dict[str, Any]
    targets: list[dict[str, Any]] = field(default_factory=list)
    image: str = ""

    @property
    def series(self) -> list[Series]:
        found = []
        for target in self.targets:
            for item in target.get("result") or []:
                pairs = item.get("values") or ([item["value"]] if "value" in item else [])
                values = [_number(v) for _, v in pairs]
                found.append(Series(legend(target.get("legendFormat", ""), item.get("metric", {})),
                                    item.get("metric", {}), [float(t) for t, _ in pairs], values))
        return found

    @property
    def status(self) -> str:
        if any("error" in t for t in self.targets):
            return "error"
        return "ok" if any(any(not math.isnan(v) for v in s.values) for s in self.series) else "no data"

    @property
    def errors(self) -> list[str]:
        return [f"{t['refId']}: {t['error']}" for t in self.targets if "error" in t]


def _number(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legendFormat: ``{{label}}`` replaced by the label's value; empty = the series' labels."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    shown = {k: v for k, v in labels.items() if k not in ("job", "instance")}
    name = shown.pop("__name__", "")
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items()))
    return f"{name}{{{inner}}}" if inner else (name or "value")


def run_queries(board: Mapping[str, Any], prometheus: Prometheus, span: TimeRange,
                variables: Mapping[str, str]) -> list[PanelResult]:
    results = []
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            continue
        result = PanelResult(panel)
        for target in panel.get("targets", []):
            entry = {"refId": target.get("refId", ""), "expr": target.get("expr", ""),
                     "legendFormat": target.get("legendFormat", "")}
            try:
                entry["query"] = substitute(entry["expr"], rate_interval=span.rate_interval, variables=variables)
            except ValueError as exc:
                entry["error"] = str(exc)
            else:
                entry.update(prometheus.query(entry["query"], span, instant=bool(target.get("instant"))))
            result.targets.append(entry)
        results.append(result)
    return results


# --- rendering ---------------------------------------------------------------------------------------------------


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
        return datetime.fromtimestamp(value / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    suffix = {"reqps": " req/s", "ops": " ops/s", "celsius": " °C", "watt": " W", "x": "×", "none": "",
              "short": ""}.get(unit, "")
    if unit.startswith("suffix:"):
        suffix = " " + unit.split(":", 1)[1].strip()
    return f"{value:.3g}{suffix}"


def _unit_of(panel: Mapping[str, Any]) -> str:
    if panel.get("type") == "heatmap":
        return panel.get("options", {}).get("yAxis", {}).get("unit", "")
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")


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
            axes.set_xlim(_when(span.start), _when(span.end))
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, timezone.utc)


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
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=timezone.utc))
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
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=timezone.utc))
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
        "figcaption{color:#444;max-width:60em}.nodata{color:#888}.error{color:#b00}</style></head><body>",
        f"<h1>{title}</h1>",
        f"<p>{html.escape(board.get('description', ''))}</p>",
        f"<p>Time range: <b>{_iso(span.start)}</b> to <b>{_iso(span.end)}</b> (step {span.step:g} s, "
        f"$__rate_interval {html.escape(span.rate_interval)}). Prometheus: {html.escape(url)}. Variables: "
        f"{html.escape(', '.join(f'{k}={v}' for k, v in sorted(variables.items())))}. "
        f'Dashboard uid <code>{html.escape(board.get("uid", ""))}</code>; raw results in '
        '<a href="results.json">results.json</a>.</p>',
    ]
    for result in results:
        panel = result.panel
        status = result.status
        note = {"ok": "", "no data": '<p class="nodata">no data</p>'}.get(
            status, '<p class="error">query error: ' + html.escape("; ".join(result.errors)) + "</p>")
        parts.append(f'<figure id="panel-{panel.get("id")}"><h2>{html.escape(panel.get("title", ""))}</h2>'
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
                    "unit": _unit_of(r.panel), "image": r.image, "status": r.status, "targets": r.targets}
                   for r in results],
    }


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise SnapshotError(f"{out} already exists and is not an empty folder (use --overwrite to replace it)")


def _publish(staging: Path, out: Path) -> None:
    """Swap the finished folder into place: ``out`` is never half-written."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "snapshot")
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class SnapshotRequest:
    prometheus: str
    dashboard: str
    out: Path
    start: str = "-1h"
    end: str = "now"
    step: str | None = None
    rate_interval: str | None = None
    scrape_interval: float = 15.0
    variables: Mapping[str, str] = field(default_factory=dict)
    dashboards_dir: Path | None = None
    timeout: float = 30.0
    overwrite: bool = False


def snapshot(request: SnapshotRequest, *, now: float | None = None) -> dict[str, Any]:
    """Take the snapshot; returns the results.json document. Raises SnapshotError before writing anything."""
    span = TimeRange.resolve(request.start, request.end, step=request.step, rate_interval=request.rate_interval,
                             scrape_interval=request.scrape_interval,
                             now=now if now is not None else datetime.now(timezone.utc).timestamp())
    board = load_dashboard(request.dashboard, request.dashboards_dir)
    _prepare_out(request.out, request.overwrite)
    variables = {k: v for k, v in request.variables.items()}
    with Prometheus(request.prometheus, timeout=request.timeout) as prometheus:
        prometheus.check()
        results = run_queries(board, prometheus, span, variables)
    request.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.tmp-", dir=request.out.parent))
    try:
        (staging / "panels").mkdir()
        for result in results:
            result.image = f"panels/{result.panel.get('id')}-{_slug(result.panel.get('title', ''))}.png"
            render_panel(result, staging / result.image, span)
        document = results_json(board, results, span, request.prometheus, variables)
        (staging / "results.json").write_text(json.dumps(document, indent=1) + "\n")
        (staging / "index.html").write_text(write_index(board, results, span, request.prometheus, variables))
        _publish(staging, request.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return document


# --- command line ------------------------------------------------------------------------------------------------


def _variable(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"\w+", name):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=REGEX, e.g. replica=replica-0")
    return name, value


def register(sub: Any) -> None:
    """Add ``snapshot`` to the appliance's argparse subparsers."""
    p = sub.add_parser("snapshot", help="render a dashboard's panels from Prometheus to PNG + HTML",
                       description="Run every panel's queries of a dashboard against Prometheus and write "
                                   "index.html, results.json and panels/*.png to --out (atomically).")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--dashboard", required=True,
                   help=f"dashboard uid: {', '.join(DASHBOARDS)}")
    p.add_argument("--from", dest="start", default="-1h", help="now-1h, -30m, Unix seconds or ISO 8601 "
                                                              "(default -1h)")
    p.add_argument("--to", dest="end", default="now", help="same forms (default now)")
    p.add_argument("--step", help="query resolution, e.g. 15s (default: range / 240, at least the scrape "
                                  "interval)")
    p.add_argument("--rate-interval", help="value of $__rate_interval (default: Grafana's max(step + scrape "
                                           "interval, 4 x scrape interval))")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus scrape interval, seconds")
    p.add_argument("--var", dest="variables", action="append", type=_variable, default=[],
                   metavar="NAME=REGEX", help="dashboard variable (default .* = All), e.g. replica=replica-0")
    p.add_argument("--dashboards-dir", type=Path, help=f"folder of dashboard JSON (default {DASHBOARDS_DIR})")
    p.add_argument("--timeout", type=float, default=30.0, help="per-query timeout, seconds")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier snapshot")
    p.add_argument("--out", type=Path, required=True, help="output folder (created; must be empty or absent)")
    # argparse reads "--from -1h" as two options unless "-1h" looks like a negative number to it; teach this
    # parser that relative times are values (it has no options that look like them).
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-\d+(?:\.\d+)?(?:ms|[smhdw])?(?:\d+(?:\.\d+)?(?:ms|[smhdw]))*$")
    p.set_defaults(handler=cmd_snapshot)


def cmd_snapshot(args: argparse.Namespace) -> int:
    request = SnapshotRequest(prometheus=args.prometheus, dashboard=args.dashboard, out=args.out, start=args.start,
                              end=args.end, step=args.step, rate_interval=args.rate_interval,
                              scrape_interval=args.scrape_interval, variables=dict(args.variables),
                              dashboards_dir=args.dashboards_dir, timeout=args.timeout,
                              overwrite=args.overwrite)
    try:
        document = snapshot(request)
    except SnapshotError as exc:
        print(f"appliance snapshot: {exc}", file=sys.stderr)
        return EXIT_USAGE
    counts: dict[str, int] = {}
    for panel in document["panels"]:
        counts[panel["status"]] = counts.get(panel["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{args.out / 'index.html'}: {len(document['panels'])} panels ({summary})")
    return EXIT_QUERY_FAILED if counts.get("error") else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance")
    register(parser.add_subparsers())
    args = parser.parse_args(["snapshot", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
