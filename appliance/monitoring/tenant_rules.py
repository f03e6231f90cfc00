"""The tenants' rules (docs/tenants.md): the accounting drift's recording rules, the tenants' alerts (held at their
quota, missing the TTFT SLO while the fleet meets it, accounting that does not add up) and the shared quota
store's."""

from __future__ import annotations

from typing import Any

from appliance.monitoring.alert import Alert, alert
from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.promql import bucket_label

RECONCILED = "appliance_tenant_reconciled_tokens_total"


def accounting_drift_record(by: str, window: str) -> str:
    """The name of the drift record grouped ``by`` over ``window``."""
    return f"{by.replace(', ', '_')}:appliance_tenant_accounting_drift:ratio_rate{window}"


def accounting_drift(selector: str, window: str, *, fleet: bool = False) -> str:
    """What tenants were charged for each replica's work over what its engine counted, minus 1, per kind (prompt,
    completion), over ``window``; per replica, or for the whole fleet. Every gateway reads every engine's counters
    (side engine: the same rise seen by each, so the max) and charges only its own requests (side tenants: summed
    over gateways). No sample while the engine counted nothing: nothing to reconcile."""
    engine = f'max by (job, replica, kind) (rate({RECONCILED}{{{selector},side="engine"}}[{window}]))'
    tenants = f'sum by (job, replica, kind) (rate({RECONCILED}{{{selector},side="tenants"}}[{window}]))'
    if not fleet:
        return f"{tenants}\n/\n({engine} > 0)\n- 1\n"
    return f"sum by (job, kind) (\n  {tenants}\n)\n/\n(sum by (job, kind) (\n  {engine}\n) > 0)\n- 1\n"


def accounting_drift_rules(app: str, window: str) -> list[dict[str, Any]]:
    """The drift per replica and over the fleet, recorded over the alert's window."""
    return [{"record": accounting_drift_record("job, replica, kind", window), "expr": accounting_drift(app, window)},
            {"record": accounting_drift_record("job, kind", window),
             "expr": accounting_drift(app, window, fleet=True)}]


def tenant_alerts(config: MonitoringConfig) -> list[Alert]:
    """The tenants' two alerts (docs/tenants.md). Each tenant's series come from every gateway (several pods on
    Kubernetes): summed by (job, tenant), so one alert per tenant, whichever pods it used."""
    app = config.selectors.appliance
    throttled = alert(
        config, "ApplianceTenantThrottled",
        "sum by (job, tenant) (rate(appliance_tenant_rate_limited_total{{app}}[{window}]))\n/\n"
        "sum by (job, tenant) (rate(appliance_tenant_requests_total{{app}}[{window}]))\n> {threshold}\n",
        "Tenant {{ $labels.tenant }} is held at its quota.",
        "{{ $value | humanizePercentage }} of the answers to tenant {{ $labels.tenant }} over {window} were 429 "
        "rate_limit_exceeded from its own quota (tokens_per_minute or requests_per_minute), above {percent}% for "
        "{for_}: its quota is short of what it sends, or its client ignores Retry-After.",
        percent=f"{config.alerts.ApplianceTenantThrottled.threshold * 100:g}")
    b = config.alerts.ApplianceTenantTTFTBurn
    w = b.window
    objective = float(config.slos.ttft.objective)
    bound = f"({b.factor} * (1 - {objective}))"
    le = bucket_label(config.slos.ttft.threshold_seconds)

    def slow(metric: str, by: str) -> str:
        return (f"(\n  1 - (\n    sum by ({by}) (rate({metric}_bucket{{{app},le=\"{le}\"}}[{w}]))\n    /\n"
                f"    sum by ({by}) (rate({metric}_count{{{app}}}[{w}]))\n  )\n)")

    # The tenant's miss ratio over the bound, unless the whole fleet's is over it too (then everyone is slow:
    # ApplianceTTFTBudgetBurn's page), and only for a tenant with enough streamed requests to judge.
    burn = alert(
        config, "ApplianceTenantTTFTBurn",
        f"{slow('appliance_tenant_ttft_seconds', 'job, tenant')} > {bound}\n"
        f"unless on (job)\n{slow('appliance_request_ttft_seconds', 'job')} > {bound}\n"
        "and on (job, tenant)\n"
        "sum by (job, tenant) (rate(appliance_tenant_ttft_seconds_count{{app}}[{window}])) > {min_request_rate}\n",
        "Tenant {{ $labels.tenant }} misses the TTFT SLO while the fleet meets it.",
        "{{ $value | humanizePercentage }} of tenant {{ $labels.tenant }}'s streamed requests over {window} had a "
        "time to first token over {threshold_seconds}s, more than {factor_g}x the budget of {budget}%, while the "
        "fleet as a whole stays within that: fair share is not protecting it, or its prompts are much longer than "
        "the others'.",
        threshold_seconds=config.slos.ttft.threshold_seconds, factor_g=f"{b.factor:g}",
        budget=round((1 - objective) * 100, 3))
    return [throttled, burn, _accounting_drift_alert(config)]


def quota_store_alert(config: MonitoringConfig) -> Alert:
    """A gateway whose shared quota store (quota_store.kind redis) does not answer: its requests fail open (no
    quota) or closed (503), as configured (docs/tenants.md). Per gateway pod: each has its own connection."""
    return alert(
        config, "ApplianceQuotaStoreUnreachable",
        "max by (job, instance) (appliance_quota_store_up{{app}}) == 0\n",
        "Gateway {{ $labels.instance }} cannot reach the shared quota store.",
        "The gateway at {{ $labels.instance }} has not reached its quota store (Redis) for {for_}: its tenants' "
        "requests are admitted without their quota checked (quota_store.failure open) or refused with 503 "
        "quota_store_unavailable (closed); appliance_quota_store_unchecked_requests_total counts which.")


def _accounting_drift_alert(config: MonitoringConfig) -> Alert:
    """Tenants charged more or less than a replica's engine counted, per kind, for long, on a replica busy enough
    to judge (docs/tenants.md). The value keeps its sign: above 0 tenants were charged more."""
    knob = config.alerts.ApplianceTenantAccountingDrift
    drift = accounting_drift_record("job, replica, kind", knob.window) + "{{app}}"
    return alert(
        config, "ApplianceTenantAccountingDrift",
        f"(\n  {drift} > {{threshold}}\n  or\n  {drift} < -{{threshold}}\n)\nand on (job, replica, kind)\n"
        f'max by (job, replica, kind) (rate({RECONCILED}{{{{app}},side="engine"}}[{{window}}])) > {{min_token_rate}}\n',
        "Tenants' {{ $labels.kind }} tokens on {{ $labels.replica }} do not add up to its engine's.",
        "Over {window} the tenants were charged {{ $value | humanizePercentage }} more (negative: less) "
        "{{ $labels.kind }} tokens for the work of {{ $labels.replica }} than its engine counted "
        "(appliance_tenant_reconciled_tokens_total, side tenants against side engine), beyond {percent}% for "
        "{for_}: work no tenant pays for, or charges for work no engine did.",
        percent=f"{knob.threshold * 100:g}")
