"""docs/runbooks/ true against the code: every dashboard panel a runbook names is on the dashboard it names, and
every label it tells on-call to read from the alert survives the alert's expression (panels named on
the wrong dashboard, "the alert's `pod` label" on alerts that aggregate `pod` away)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = sorted((REPO / "docs" / "runbooks").glob("Appliance*.md")) + [REPO / "docs" / "runbooks" / "Watchdog.md"]
# The runbooks' convention: **Appliance / Capacity** (`appliance-capacity`): *Panel*, *Panel*; **Hardware**: ...
DASHBOARD_REF = re.compile(r"\*\*(?P<name>[^*]+)\*\*(?: \(`(?P<uid>[a-z-]+)`\))?:(?P<panels>[^;]*?)(?=\*\*|;|$)")
PANEL = re.compile(r"(?<![*\w])\*(?P<title>[^*]+)\*(?!\*)")
ALERT_LABEL = re.compile(r"the alert's `(?P<label>[a-z_]+)` label")
AGGREGATION = re.compile(r"\b(?:sum|min|max|avg|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\b"
                         r"\s*(?:(?P<kind>by|without)\s*\((?P<labels>[^)]*)\))?\s*\(")


def _dashboards() -> dict[str, tuple[str, set[str]]]:
    """Title -> (uid, every panel title, rows included), from the generated dashboards/*.json."""
    boards = {}
    for path in sorted((REPO / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        titles: set[str] = set()
        stack = list(board["panels"])
        while stack:
            panel = stack.pop()
            titles.add(panel.get("title", ""))
            stack.extend(panel.get("panels", []))
        boards[board["title"]] = (board["uid"], titles)
    return boards


def _board(name: str, boards: dict[str, tuple[str, set[str]]]) -> str | None:
    """Runbooks name a dashboard by its title, or by the part after "Appliance / " once the context is clear."""
    for title in boards:
        if name in (title, title.removeprefix("Appliance / ")):
            return title
    return None


def _panel_references(text: str) -> list[tuple[str, str | None, str]]:
    """(dashboard name, uid or None, panel title) for each panel a runbook names after a dashboard."""
    found = []
    for line in text.splitlines():
        for ref in DASHBOARD_REF.finditer(line):
            for panel in PANEL.finditer(ref["panels"]):
                found.append((ref["name"], ref["uid"], panel["title"]))
    return found


def _rules() -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Alert rules by name (one alert may have several rules), and recording rules' expressions by record."""
    alerts: dict[str, list[dict]] = {}
    records: dict[str, str] = {}
    for name in ("alerts.rules.yaml", "recording.rules.yaml"):
        for group in yaml.safe_load((REPO / "alerts" / name).read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    alerts.setdefault(rule["alert"], []).append(rule)
                else:
                    records[rule["record"]] = rule["expr"]
    return alerts, records


def _expressions(expr: str, records: dict[str, str]) -> list[str]:
    """The expression and, transitively, those of the recording rules it reads: an aggregation in a recorded
    series drops labels just as one in the alert's own expression does."""
    seen, todo, out = set(), [expr], []
    while todo:
        current = todo.pop()
        out.append(current)
        for name in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", current):
            if name in records and name not in seen:
                seen.add(name)
                todo.append(records[name])
    return out


def label_survives(label: str, rule: dict, records: dict[str, str]) -> bool:
    """A simple, conservative rule: a label the rule sets survives; else every aggregation in the expression (or
    a recording rule it reads) must keep it: `by (...)` naming it, `without (...)` not naming it."""
    if label in rule.get("labels", {}):
        return True
    for expr in _expressions(rule["expr"], records):
        for aggregation in AGGREGATION.finditer(expr):
            named = {part.strip() for part in (aggregation["labels"] or "").split(",")}
            if aggregation["kind"] != "without" and label not in named:
                return False
            if aggregation["kind"] == "without" and label in named:
                return False
    return True


def test_label_rule_on_known_expressions() -> None:
    """The checker itself, on the shapes the rules use."""
    rule = {"expr": 'max by (job, instance, replica) (x{job="a"}) == 1 and on (job) y', "labels": {"severity": "w"}}
    assert label_survives("replica", rule, {}) and label_survives("severity", rule, {})
    assert not label_survives("pod", rule, {})
    assert label_survives("pod", {"expr": "avg_over_time(x[5m]) > 16"}, {})
    assert not label_survives("pod", {"expr": "job:x:sum == 0"}, {"job:x:sum": "sum by (job) (x)"})
    assert not label_survives("pod", {"expr": "sum(x) == 0"}, {})
    assert label_survives("pod", {"expr": "sum without (le) (x)"}, {})


@pytest.mark.parametrize("path", RUNBOOKS, ids=lambda p: p.stem)
def test_named_panels_are_on_the_named_dashboard(path: Path) -> None:
    boards = _dashboards()
    wrong = []
    for name, uid, panel in _panel_references(path.read_text()):
        title = _board(name, boards)
        if title is None:
            wrong.append(f"no dashboard {name!r}")
        elif uid is not None and boards[title][0] != uid:
            wrong.append(f"{name!r} has uid {boards[title][0]}, not {uid}")
        elif panel not in boards[title][1]:
            wrong.append(f"no panel {panel!r} on {title!r}")
    assert wrong == []


def test_runbooks_name_panels_in_the_convention_this_test_reads() -> None:
    """A guard for the parser: it must find the panel references that are there, or the check above is empty."""
    assert sum(len(_panel_references(path.read_text())) for path in RUNBOOKS) >= 40


@pytest.mark.parametrize("path", RUNBOOKS, ids=lambda p: p.stem)
def test_labels_read_from_the_alert_survive_its_expression(path: Path) -> None:
    alerts, records = _rules()
    rules = alerts[path.stem]
    lost = sorted({match["label"] for match in ALERT_LABEL.finditer(path.read_text())
                   for rule in rules if not label_survives(match["label"], rule, records)})
    assert lost == [], f"{path.stem} aggregates these labels away"


def test_no_ready_replica_runbook_tells_what_clients_get() -> None:
    """Issue 19: it said requests queue then get 429; the gateway answers 503 no_ready_replica with Retry-After."""
    source = (REPO / "appliance" / "gateway" / "admission" / "queue.py").read_text()
    assert 'code="no_ready_replica"' in source and '"Retry-After"' in source
    impact = (REPO / "docs" / "runbooks" / "ApplianceNoReadyReplica.md").read_text().split("## Impact", 1)[1]
    impact = impact.split("##", 1)[0]
    assert "503" in impact and "`no_ready_replica`" in impact and "Retry-After" in impact
