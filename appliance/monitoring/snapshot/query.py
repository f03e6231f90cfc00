"""The Prometheus query client of ``appliance snapshot``: a dashboard's targets, with Grafana's variables
substituted, run against Prometheus' HTTP API, and their results as series per panel."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from appliance.monitoring.promql import substitute
from appliance.monitoring.snapshot.timerange import SnapshotError, TimeRange


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
    row: str = ""  # the title of the dashboard row the panel is in

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


def panels_in_rows(board: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row title, panel) for every panel with queries, in dashboard order; a collapsed row's panels are nested
    in the row, an expanded row's follow it."""
    found, row = [], ""
    for panel in board.get("panels", []):
        if panel.get("type") != "row":
            found.append((row, panel))
            continue
        row = panel.get("title", "")
        found += [(row, inner) for inner in panel.get("panels", [])]
    return found


def run_queries(board: Mapping[str, Any], prometheus: Prometheus, span: TimeRange,
                variables: Mapping[str, str]) -> list[PanelResult]:
    results = []
    for row, panel in panels_in_rows(board):
        result = PanelResult(panel, row=row)
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
