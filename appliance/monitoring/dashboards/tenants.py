"""Appliance / Tenants: who is using the appliance, is any team held at its quota, and does fair share keep
every team within the TTFT SLO while one floods (docs/tenants.md)?

Every tenant series is the gateway's (``appliance_tenant_*``), labelled by the configured tenant names only, and
each gateway reports its own (several pods on Kubernetes): panels sum by tenant. The ``tenant`` variable
(multi-value, All) filters every panel; shares are of all tenants' tokens whatever the selection, so a share
reads the same whichever tenants are shown. The SLO line and the alert bounds are alerts/config.yaml's.
"""

from __future__ import annotations

from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import Section, Selectors, dashboard, label_values, resolve
from appliance.monitoring.dashboards.panels import RATE, heatmap, rate, runbooks, stat, target, tidy, timeseries
from appliance.monitoring.promql import bucket_label
from appliance.monitoring.tenant_rules import accounting_drift

UID = "appliance-tenants"
THROTTLED, TTFT_BURN = "ApplianceTenantThrottled", "ApplianceTenantTTFTBurn"
ACCOUNTING_DRIFT = "ApplianceTenantAccountingDrift"
QUOTA_STORE = "ApplianceQuotaStoreUnreachable"
REQUESTS, TOKENS = "appliance_tenant_requests_total", "appliance_tenant_tokens_total"
TTFT, QUEUE_WAIT = "appliance_tenant_ttft_seconds", "appliance_tenant_queue_wait_seconds"
RATE_LIMITED = "appliance_tenant_rate_limited_total"
# What a tenant is charged: the engines' reports and the gateway's estimate of work none reported (cached_prompt is a
# part of prompt: never add it to the others).
SERVED = 'kind=~"prompt|completion|estimated"'


def p95(histogram: str, selector: str, *, by: str) -> str:
    return f"histogram_quantile(0.95, sum by (le, {by}) (rate({histogram}_bucket{{{selector}}}[{RATE}])))"


def build(config: MonitoringConfig | None = None) -> dict[str, Any]:  # noqa: PLR0915 - one list of panels
    config = resolve(config)
    sel = Selectors.of(config)
    gw = sel.gateway
    t = f'{gw}, tenant=~"$tenant"'  # the selected tenants' series
    slo = config.slos.ttft
    le = bucket_label(slo.threshold_seconds)
    budget = tidy(1 - slo.objective)
    burn = config.alerts.ApplianceTenantTTFTBurn
    bound = tidy(burn.factor * budget)
    throttled = config.alerts.ApplianceTenantThrottled
    drift = config.alerts.ApplianceTenantAccountingDrift

    served, everyone_served = f"{t}, {SERVED}", f"{gw}, {SERVED}"
    in_slo, fleet_in_slo = f'{t}, le="{le}"', f'{gw}, le="{le}"'
    prompt, cached, ok = f'{t}, kind="prompt"', f'{t}, kind="cached_prompt"', f'{t}, code=~"2.."'
    share = (f"{rate(TOKENS, served, by='tenant')}\n/ ignoring (tenant) group_left ()\n"
             f"({rate(TOKENS, everyone_served)} > 0)")
    attainment = (f"{rate(TTFT + '_bucket', in_slo, by='tenant')}\n/\n"
                  f"({rate(TTFT + '_count', t, by='tenant')} > 0)")
    fleet_misses = (f"1 - {rate('appliance_request_ttft_seconds_bucket', fleet_in_slo)} / "
                    f"({rate('appliance_request_ttft_seconds_count', gw)} > 0)")
    refused_share = f"{rate(RATE_LIMITED, t, by='tenant')}\n/\n({rate(REQUESTS, t, by='tenant')} > 0)"
    slo_text = f"{slo.threshold_seconds:g} s"

    now = [
        stat(1, "Tenants sending", target(f"count({rate(REQUESTS, t, by='tenant')} > 0) or vector(0)"),
             unit="none", description="Selected tenants that sent at least one request over the interval."),
        stat(2, "Throttled tenants", target(f"count({rate(RATE_LIMITED, t, by='tenant')} > 0) or vector(0)"),
             unit="none", thresholds=[(None, "green"), (1, "orange")], links=runbooks(config, THROTTLED),
             description="Selected tenants that got at least one quota 429 (rate_limit_exceeded) over the "
                         "interval: a tenant above its tokens_per_minute or requests_per_minute."),
        stat(3, "Worst tenant TTFT attainment", target(f"min({attainment})"), unit="percentunit", decimals=1,
             thresholds=[(None, "red"), (slo.objective, "green")], links=runbooks(config, TTFT_BURN),
             description=f"The lowest share, over the selected tenants, of streamed requests whose time to first "
                         f"token was within {slo_text} (the SLO bucket); the objective is {slo.objective:.1%}."),
        stat(4, "Largest token share", target(f"max({share})"), unit="percentunit", decimals=0,
             description="The largest share of all tenants' prompt and completion tokens that one selected "
                         "tenant took over the interval."),
        stat(5, "Queued now", target(f"sum(appliance_tenant_queued_requests{{{t}}})"), unit="none",
             thresholds=[(None, "green"), (1, "orange")],
             description="Requests of the selected tenants waiting in the gateways' admission queues."),
        stat(6, "In flight now", target(f"sum(appliance_tenant_in_flight_requests{{{t}}})"), unit="none",
             description="Requests of the selected tenants held at the replicas."),
    ]
    usage = [
        timeseries(7, "Tokens per second by tenant",
                   target(rate(TOKENS, served, by="tenant, kind"), "{{tenant}} {{kind}}"),
                   unit="suffix: tok/s", stack=True,
                   description="Prompt tokens in and completion tokens out per second for each tenant, from the "
                               "engines' usage reports (streams included), and the tokens charged that no engine "
                               "reported (estimated: a stream's tail after its client left, a non-streaming request "
                               "left or timed out), stacked."),
        timeseries(8, "Share of tokens by tenant", target(share, "{{tenant}}"), unit="percentunit", min_=0,
                   max_=1, stack=True,
                   description="Each tenant's part of all tenants' prompt and completion tokens: who is using "
                               "the GPUs. A tenant near 100 % while others wait is what fair share bounds."),
        timeseries(9, "Requests by tenant and code class",
                   *(target(rate(REQUESTS, f'{t}, code=~"{digit}.."', by="tenant"), f"{{{{tenant}}}} {digit}xx")
                     for digit in "245"),
                   unit="reqps", w=8,
                   description="Answers per second for each tenant by HTTP status class: 2xx served, 4xx "
                               "refused (429: its quota or admission control; 401/400: the client), 5xx failed."),
        timeseries(10, "Prompt tokens per request by tenant",
                   target(f"{rate(TOKENS, prompt, by='tenant')}\n/\n({rate(REQUESTS, ok, by='tenant')} > 0)",
                          "{{tenant}}"),
                   unit="none", w=8,
                   description="Mean prompt length of each tenant's served requests. A tenant whose prompts "
                               "are much longer than the others' has a longer TTFT (prefill) whatever the "
                               "queue order."),
        timeseries(11, "Prefix cache share of prompts by tenant",
                   target(f"{rate(TOKENS, cached, by='tenant')}\n/\n({rate(TOKENS, prompt, by='tenant')} > 0)",
                          "{{tenant}}"),
                   unit="percentunit", w=8, min_=0, max_=1,
                   description="Share of each tenant's prompt tokens the engines found in their prefix cache "
                               "(cached_prompt over prompt): prefill that tenant did not cost."),
        timeseries(22, "Accounting drift by replica",
                   target(accounting_drift(gw, RATE), "{{replica}} {{kind}}"),
                   target(accounting_drift(gw, RATE, fleet=True), "all replicas {{kind}}"),
                   unit="percentunit", w=16,
                   thresholds=[(None, "red"), (-drift.threshold, "green"), (drift.threshold, "red")],
                   links=runbooks(config, ACCOUNTING_DRIFT),
                   description=f"What all tenants were charged for each replica's work over what its engine "
                               f"counted (vllm:prompt_tokens_total, vllm:generation_tokens_total), minus 1, by kind: "
                               f"0 when the accounting adds up; above 0 tenants paid for more than the engine did. "
                               f"Every tenant, whatever the selection. Requests in flight at the interval's edges "
                               f"make short intervals noisy: {ACCOUNTING_DRIFT} judges {drift.window} at a time, "
                               f"beyond the dashed lines for {drift.for_}."),
        timeseries(24, "Work no engine reported, by how it was charged",
                   target(f"sum by (charged) (rate(appliance_tenant_unseen_requests_total{{{gw}}}[{RATE}]))",
                          "{{charged}}"),
                   unit="reqps", w=8, min_=0, links=runbooks(config, ACCOUNTING_DRIFT),
                   description="Requests whose work no engine reported (a non-streaming answer left or timed out, "
                               "a stream's unread tail), charged as the engine counted it once its replica came to "
                               "rest (engine) or as the gateway estimated it (estimate: no rest within "
                               "gateway.unseen_hold_seconds, or the engine also served others). Every tenant."),
    ]
    latency = [
        timeseries(12, "TTFT p95 by tenant", target(p95(TTFT, t, by="tenant"), "{{tenant}}"),
                   target(f"histogram_quantile(0.95, sum by (le) "
                          f"(rate(appliance_request_ttft_seconds_bucket{{{gw}}}[{RATE}])))", "all tenants"),
                   unit="s", thresholds=[(None, "green"), (slo.threshold_seconds, "red")],
                   links=runbooks(config, TTFT_BURN),
                   description=f"95th percentile of each tenant's time to first token at the gateway (queue "
                               f"wait included), and the whole gateway's; the dashed line is the {slo_text} "
                               f"SLO. One tenant high while all tenants stay low: fair share or prompt length."),
        timeseries(13, "TTFT SLO misses by tenant", target(f"1 - ({attainment})", "{{tenant}}"),
                   target(fleet_misses, "all tenants"), unit="percentunit", min_=0, max_=1,
                   thresholds=[(None, "green"), (budget, "orange"), (bound, "red")],
                   links=runbooks(config, TTFT_BURN),
                   description=f"Share of each tenant's streamed requests over the {slo_text} SLO bucket, and "
                               f"the whole gateway's. Orange: the budget ({budget:.0%}); red: "
                               f"ApplianceTenantTTFTBurn's bound ({burn.factor:g}x the budget, over "
                               f"{burn.window}, while all tenants stay under it)."),
        timeseries(14, "Queue wait p95 by tenant", target(p95(QUEUE_WAIT, t, by="tenant"), "{{tenant}}"),
                   unit="s", w=8,
                   description="95th percentile of each tenant's wait in the admission queue: with fair share "
                               "on, a tenant that floods waits behind its own requests, not the others."),
        heatmap(15, "Tenant TTFT distribution", TTFT, t, unit="s", w=8,
                description="The selected tenants' requests per second in each TTFT bucket (pick one tenant "
                            "to see its own)."),
        heatmap(16, "Tenant queue wait distribution", QUEUE_WAIT, t, unit="s", w=8,
                description="The selected tenants' requests per second in each admission-queue wait bucket."),
    ]
    quotas = [
        timeseries(17, "Quota 429s by tenant and limit",
                   target(rate(RATE_LIMITED, t, by="tenant, limit"), "{{tenant}} {{limit}}"), unit="reqps",
                   links=runbooks(config, THROTTLED),
                   description="Requests per second refused with 429 rate_limit_exceeded because the tenant's "
                               "own quota was spent, by limit: tokens (tokens_per_minute) or requests "
                               "(requests_per_minute)."),
        timeseries(18, "Quota 429 share by tenant", target(refused_share, "{{tenant}}"), unit="percentunit",
                   min_=0, max_=1, thresholds=[(None, "green"), (throttled.threshold, "red")],
                   links=runbooks(config, THROTTLED),
                   description=f"Share of each tenant's answers that were quota 429s; the dashed line is "
                               f"ApplianceTenantThrottled's threshold (over {throttled.window}, for "
                               f"{throttled.for_})."),
        timeseries(19, "Quota remaining by tenant",
                   target(f"min by (tenant, limit) (appliance_tenant_quota_remaining_ratio{{{t}}})",
                          "{{tenant}} {{limit}}"),
                   unit="percentunit", w=8, max_=1, thresholds=[(None, "red"), (0.1, "green")],
                   links=runbooks(config, THROTTLED),
                   description="Level of each tenant's quota bucket over its capacity (one minute's worth), "
                               "the lowest of the gateways; only tenants with that quota. At 0 or below (in "
                               "debt: completion tokens are charged as they stream) its requests get 429 until "
                               "the bucket refills."),
        timeseries(20, "In flight by tenant",
                   target(f"sum by (tenant) (appliance_tenant_in_flight_requests{{{t}}})", "{{tenant}}"),
                   unit="none", w=8, stack=True,
                   description="Requests of each tenant held at the replicas, all gateways: fair share bounds "
                               "one tenant's part of a replica while others wait."),
        timeseries(21, "Queued by tenant",
                   target(f"sum by (tenant) (appliance_tenant_queued_requests{{{t}}})", "{{tenant}}"),
                   unit="none", w=8, stack=True, links=runbooks(config, "ApplianceQueueBacklog"),
                   description="Requests of each tenant waiting in the admission queues, all gateways."),
        timeseries(23, "Quota store",
                   target(f"min by (instance) (appliance_quota_store_up{{{gw}}})", "{{instance}} reachable"),
                   target(f"sum by (direction) (rate(appliance_quota_store_unchecked_requests_total{{{gw}}}"
                          f"[{RATE}]))", "unchecked, fails {{direction}}"),
                   unit="none", w=8, links=runbooks(config, QUOTA_STORE),
                   description="With several gateways sharing the tenants' quotas in Redis (quota_store.kind: "
                               "redis): 1 while each gateway reaches the store; requests per second admitted "
                               "unchecked (failure open) or refused 503 (closed) while it does not. No series "
                               "with the embedded buckets."),
    ]
    sections = [Section(101, "Tenants now", now), Section(102, "Usage", usage),
                Section(103, "Latency against the SLO", latency), Section(104, "Quotas and admission", quotas)]
    tenant = label_values("tenant", "tenant", f"{REQUESTS}{{{gw}}}")
    return dashboard(UID, "Appliance / Tenants",
                     "Who is using the appliance, is a team held at its quota, and does fair share keep every "
                     "team within the TTFT SLO?", sections, ["tenants"], sel, extra_variables=[tenant])
