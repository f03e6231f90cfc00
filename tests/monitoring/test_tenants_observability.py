"""The tenants' dashboard and alerts: the `tenant` variable filters every panel, the bounds the panels
draw are the alerts' own from alerts/config.yaml, and the alerts' knobs reach the rules."""

from __future__ import annotations

import re
from typing import Any

import yaml

from appliance.monitoring import rules
from appliance.monitoring.config import CONFIG_PATH, load_config, parse_config
from appliance.monitoring.dashboards import build_dashboards, tenants
from appliance.monitoring.promql import metric_names, substitute


def _board(raw: dict[str, Any] | None = None) -> dict[str, Any]:
    config = parse_config(raw if raw is not None else yaml.safe_load(CONFIG_PATH.read_text()))
    return build_dashboards(config)[tenants.UID]


def _panel(board: dict[str, Any], title: str) -> dict[str, Any]:
    [panel] = [p for p in board["panels"] if p["title"] == title]
    return panel


def _steps(panel: dict[str, Any]) -> list[Any]:
    return [step["value"] for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_the_tenant_variable_lists_the_configured_tenants_and_filters_every_tenant_series() -> None:
    board = _board()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    tenant = variables["tenant"]
    assert tenant["multi"] and tenant["includeAll"] and tenant["allValue"] == ".*"
    assert tenant["query"]["query"] == 'label_values(appliance_tenant_requests_total{job="appliance"}, tenant)'
    unfiltered = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            # Each selector of a tenant series filters by $tenant, except a share's denominator (all tenants) and
            # the accounting's reconciliation and its unseen work (per replica, of all tenants: no tenant label).
            for name, matchers in re.findall(r"(appliance_tenant_\w+)\{([^}]*)\}", target["expr"]):
                if 'tenant=~"$tenant"' not in matchers:
                    unfiltered.append((panel["title"], name))
    assert set(unfiltered) == {("Largest token share", "appliance_tenant_tokens_total"),
                               ("Share of tokens by tenant", "appliance_tenant_tokens_total"),
                               ("Accounting drift by replica", "appliance_tenant_reconciled_tokens_total"),
                               ("Work no engine reported, by how it was charged",
                                "appliance_tenant_unseen_requests_total")}


def test_the_share_is_of_all_tenants_and_excludes_cached_prompt_tokens() -> None:
    """What each tenant was charged (the engines' reports and the gateway's estimates), never the cached part of
    the prompt counted twice."""
    [target] = _panel(_board(), "Share of tokens by tenant")["targets"]
    assert target["expr"].count('kind=~"prompt|completion|estimated"') == 2 and "cached_prompt" not in target["expr"]
    assert "ignoring (tenant) group_left ()" in target["expr"]


def test_snapshots_can_pick_a_tenant() -> None:
    """`appliance snapshot --var tenant=...` substitutes the variable; without it, All."""
    [target, *_] = _panel(_board(), "TTFT p95 by tenant")["targets"]
    assert 'tenant=~"batch"' in substitute(target["expr"], variables={"tenant": "batch"})
    assert 'tenant=~".*"' in substitute(target["expr"])


def test_panels_draw_the_alerts_bounds_from_the_config() -> None:
    raw = yaml.safe_load(CONFIG_PATH.read_text())
    raw["alerts"]["ApplianceTenantThrottled"]["threshold"] = 0.25
    raw["alerts"]["ApplianceTenantTTFTBurn"]["factor"] = 3
    raw["slos"]["ttft"]["threshold_seconds"] = 1.0
    board = _board(raw)
    assert 0.25 in _steps(_panel(board, "Quota 429 share by tenant"))
    assert _steps(_panel(board, "TTFT SLO misses by tenant")) == [None, 0.05, 0.15]
    assert 1.0 in _steps(_panel(board, "TTFT p95 by tenant"))
    exprs = [t["expr"] for t in _panel(board, "TTFT SLO misses by tenant")["targets"]]
    assert all('le="1.0"' in expr for expr in exprs)


def test_each_tenant_alert_links_from_a_panel_of_the_tenants_dashboard() -> None:
    linked = {link["title"] for p in _board()["panels"] for link in p.get("links", [])}
    assert {"Runbook: ApplianceTenantThrottled", "Runbook: ApplianceTenantTTFTBurn",
            "Runbook: ApplianceTenantAccountingDrift"} <= linked


def test_the_accounting_drift_panel_reads_the_alerts_records_and_draws_its_bounds() -> None:
    """The panel shows the drift as the alert's records compute it (per replica, and the fleet's), over the
    dashboard's interval, with the alert's threshold either side of 0 from alerts/config.yaml."""
    raw = yaml.safe_load(CONFIG_PATH.read_text())
    raw["alerts"]["ApplianceTenantAccountingDrift"].update(threshold=0.2, window="1h")
    panel = _panel(_board(raw), "Accounting drift by replica")
    assert _steps(panel) == [None, -0.2, 0.2]
    exprs = [t["expr"] for t in panel["targets"]]
    records = {rule["record"]: rule["expr"] for group in rules.recording_groups(parse_config(raw))
               for rule in group["rules"]}
    assert exprs == [records[f"{level}:appliance_tenant_accounting_drift:ratio_rate1h"].replace(
        "[1h]", "[$__rate_interval]") for level in ("job_replica_kind", "job_kind")]


def _tenant_rules(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups = rules.rule_groups(raw)
    return {rule["alert"]: rule for group in groups for rule in group["rules"]
            if rule.get("alert", "").startswith("ApplianceTenant")}


def test_the_alerts_knobs_come_from_the_config() -> None:
    raw = load_config().model_dump(by_alias=True)
    raw["alerts"]["ApplianceTenantThrottled"] = {"threshold": 0.3, "window": "20m", "for": "1h"}
    raw["alerts"]["ApplianceTenantTTFTBurn"] = {"factor": 4, "window": "1h", "min_request_rate": 0.5,
                                                "for": "5m", "severity": "critical"}
    found = _tenant_rules(raw)
    throttled, burn = found["ApplianceTenantThrottled"], found["ApplianceTenantTTFTBurn"]
    assert throttled["for"] == "1h" and "[20m]" in throttled["expr"] and throttled["expr"].endswith("> 0.3\n")
    assert throttled["labels"]["severity"] == "warning"
    assert burn["for"] == "5m" and burn["labels"]["severity"] == "critical"
    assert "[1h]" in burn["expr"] and "[30m]" not in burn["expr"] and "(4 * (1 - 0.95))" in burn["expr"]
    assert burn["expr"].rstrip().endswith("> 0.5")


def test_the_ttft_burn_compares_the_tenant_with_the_whole_gateway() -> None:
    burn = _tenant_rules(load_config().model_dump(by_alias=True))["ApplianceTenantTTFTBurn"]
    assert metric_names(burn["expr"]) == {
        "appliance_tenant_ttft_seconds_bucket", "appliance_tenant_ttft_seconds_count",
        "appliance_request_ttft_seconds_bucket", "appliance_request_ttft_seconds_count"}
    assert "unless on (job)" in burn["expr"] and "and on (job, tenant)" in burn["expr"]
    assert burn["expr"].count('le="0.8"') == 2  # the SLO bucket of both histograms
