"""Appliance / Service & SLOs: is the service meeting its SLOs? Traffic, errors, latency and burn rates.

The SLOs are the alert rules' own (alerts/config.yaml), so that a panel and the page agree.
"""

from __future__ import annotations

from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import Section, Selectors, dashboard, resolve
from appliance.monitoring.dashboards.panels import (
    RATE,
    heatmap,
    percentiles,
    rate,
    runbooks,
    stat,
    target,
    tidy,
    timeseries,
)
from appliance.monitoring.promql import bucket_label

UID = "appliance-overview"
TTFT_BURN, AVAILABILITY_BURN = "ApplianceTTFTBudgetBurn", "ApplianceAvailabilityBudgetBurn"
LOOP_LAG = "ApplianceEventLoopLagging"


def build(config: MonitoringConfig | None = None) -> dict[str, Any]:
    config = resolve(config)
    sel = Selectors.of(config)
    slos = config.slos
    gw = sel.gateway
    requests = "appliance_requests_total"
    ttft = "appliance_request_ttft_seconds"
    total = rate(requests, gw)
    server_errors = gw + f', code=~"{slos.availability.error_code_regex}"'
    within_slo = gw + f', le="{bucket_label(slos.ttft.threshold_seconds)}"'
    errors = f"({rate(requests, server_errors)} or vector(0))"
    attainment = f"{rate(ttft + '_bucket', within_slo)} / {rate(ttft + '_count', gw)}"
    ttft_budget = tidy(1 - slos.ttft.objective)
    availability_budget = tidy(1 - slos.availability.objective)
    ttft_burn = f"(1 - {attainment}) / {ttft_budget:.6g}"
    availability_burn = f"({errors} / {total}) / {availability_budget:.6g}"
    slo = f"{slos.ttft.threshold_seconds:g} s"
    page_burn = config.page_burn
    burn_steps = [(None, "green"), (1, "orange"), (page_burn, "red")]
    ttft_objective = slos.ttft.objective
    lag = "appliance_event_loop_lag_seconds"
    lag_knobs = config.alerts.ApplianceEventLoopLagging

    now = [
        stat(1, "Request rate", target(total), unit="reqps", links=runbooks(config, "ApplianceDown"),
             description="Requests per second answered by the gateway, all routes and status codes."),
        stat(2, "Error ratio", target(f"{errors} / {total}"), unit="percentunit", decimals=2,
             thresholds=[(None, "green"), (availability_budget, "orange"), (10 * availability_budget, "red")],
             links=runbooks(config, AVAILABILITY_BURN),
             description=f"Share of requests answered with a status matching "
                         f"{slos.availability.error_code_regex!r}: the errors of the availability SLO "
                         f"(alerts/config.yaml). 429s are admission control shedding load on purpose and count "
                         f"only when that regex says so."),
        stat(3, "TTFT SLO attainment", target(attainment), unit="percentunit", decimals=1,
             thresholds=[(None, "red"), (ttft_objective, "green")], links=runbooks(config, TTFT_BURN),
             description=f"Fraction of streamed requests whose time to first token (at the gateway) was within "
                         f"{slo}, the SLO bucket. The objective is {ttft_objective:.1%}."),
        stat(4, "TTFT error-budget burn", target(ttft_burn), unit="x", decimals=1, thresholds=burn_steps,
             links=runbooks(config, TTFT_BURN),
             description=f"How fast the TTFT error budget ({ttft_budget:.1%} of requests) is being spent: 1 = "
                         f"exactly on budget over the SLO period; {page_burn:g} is the fastest burn rate "
                         f"that pages."),
        stat(5, "Availability burn", target(availability_burn), unit="x", decimals=1, thresholds=burn_steps,
             links=runbooks(config, AVAILABILITY_BURN),
             description=f"Error ratio over the availability error budget ({availability_budget:.2%}); 1 = on "
                         f"budget, {page_burn:g} pages."),
        stat(6, "Ready replicas", target(f'sum(appliance_replica_state{{{sel.owners}, state="ready"}})'), unit="none",
             thresholds=[(None, "red"), (1, "green")], links=runbooks(config, "ApplianceNoReadyReplica"),
             description="Replicas the gateway routes to. Zero means every request fails (no ready replica)."),
    ]
    traffic = [
        timeseries(7, "Requests by route and code", target(rate(requests, gw, by="route, code"),
                                                            "{{route}} {{code}}"), unit="reqps", stack=True,
                   description="Request rate by route (completions, chat) and HTTP status, stacked."),
        timeseries(8, "Errors by code", target(rate(requests, gw + ', code!~"2.."', by="code"), "{{code}}"),
                   unit="reqps", links=runbooks(config, AVAILABILITY_BURN, "ApplianceLoadShedding"),
                   description="Non-2xx responses per second by status: 429 = admission control shedding load, "
                               "503 = draining or no ready replica, 502/504 = engine failures, 4xx = client errors."),
    ]
    slo_panels = [
        timeseries(9, "TTFT percentiles (gateway)", *percentiles(ttft, gw), unit="s",
                   thresholds=[(None, "green"), (slos.ttft.threshold_seconds, "red")],
                   links=runbooks(config, TTFT_BURN, "ApplianceLatencyDrift"),
                   description=f"Time to first token as clients see it, from arrival at the gateway (queue wait "
                               f"included). The dashed line is the {slo} SLO."),
        timeseries(10, "TTFT SLO attainment over time", target(attainment, "attainment"), unit="percentunit",
                   min_=0, max_=1, thresholds=[(None, "red"), (ttft_objective, "green")],
                   links=runbooks(config, TTFT_BURN),
                   description=f"Fraction of requests with TTFT within {slo} per interval; below the dashed "
                               f"{ttft_objective:.1%} line the error budget burns faster than allowed."),
        timeseries(11, "Error-budget burn rate", target(ttft_burn, "TTFT"), target(availability_burn, "availability"),
                   unit="x", thresholds=[(None, "green"), (1, "red")],
                   links=runbooks(config, TTFT_BURN, AVAILABILITY_BURN),
                   description="Burn rate of the TTFT and availability error budgets per interval (1 = on "
                               "budget). The alerts use the same ratios over fixed 5m/1h/6h windows."),
    ]
    latency = [
        timeseries(12, "ITL percentiles (gateway)", *percentiles("appliance_request_itl_seconds", gw), unit="s",
                   description="Inter-token latency: the gap between consecutive streamed chunks. Rises with "
                               "batch size (decode is bandwidth bound) and with preemptions."),
        timeseries(13, "E2E latency percentiles (gateway)", *percentiles("appliance_request_e2e_seconds", gw),
                   unit="s", description="Arrival at the gateway to the last byte; grows with output length, so "
                                         "compare with TTFT and ITL before blaming the engine."),
        timeseries(14, "Queue wait percentiles (gateway)",
                   *percentiles("appliance_request_queue_wait_seconds", gw), unit="s",
                   description="Time spent in the gateway's admission queue before a replica took the request; "
                               "non-zero means every replica is at its concurrency limit."),
        timeseries(15, "Tokens per second", target(rate("appliance_tokens_total", gw, by="kind"), "{{kind}}"),
                   unit="suffix: tok/s",
                   description="Prompt tokens in and completion tokens out per second, from the engines' usage "
                               "reports as relayed by the gateway."),
        timeseries(16, "Engine TTFT p95 by replica (vLLM)",
                   target(f"histogram_quantile(0.95, sum by (le, replica) "
                          f"(rate(vllm:time_to_first_token_seconds_bucket{{{sel.engine}}}[{RATE}])))", "{{replica}}"),
                   unit="s", description="TTFT measured inside each vLLM engine (no gateway queue); the gap to "
                                         "the gateway's TTFT is queueing, routing and network."),
        timeseries(21, "Event-loop lag (gateway)", *percentiles(lag, gw, by="instance", quantiles=(0.5, 0.99)),
                   unit="s", thresholds=[(None, "green"), (lag_knobs.threshold, "red")],
                   links=runbooks(config, LOOP_LAG),
                   description=f"How late a timer on each gateway's event loop fired: how long every first token, "
                               f"relayed stream event and /health answer waited for that one loop. The dashed "
                               f"line is the {LOOP_LAG} threshold ({lag_knobs.threshold:g} s at p99 over "
                               f"{lag_knobs.window}). High together with TTFT and ITL: the gateway's CPU is "
                               f"saturated or something blocks its loop, not the engines."),
    ]
    distributions = [
        heatmap(17, "TTFT distribution", ttft, gw, unit="s",
                description="Requests per second in each TTFT bucket: shows bimodal latency (cold prefill, "
                            "preemption) that percentiles hide."),
        heatmap(18, "ITL distribution", "appliance_request_itl_seconds", gw, unit="s",
                description="Chunk gaps per second in each inter-token-latency bucket."),
        heatmap(19, "E2E latency distribution", "appliance_request_e2e_seconds", gw, unit="s",
                description="Requests per second in each end-to-end latency bucket."),
        heatmap(20, "Queue wait distribution", "appliance_request_queue_wait_seconds", gw, unit="s",
                description="Requests per second in each admission-queue wait bucket."),
        heatmap(22, "Event-loop lag distribution", lag, gw, unit="s",
                description="Event-loop probes per second in each lag bucket, all gateways together: rare long "
                            "stalls (a blocking call, a long garbage-collector pass) that the p99 smooths away."),
    ]
    sections = [Section(101, "Service level now", now), Section(102, "Traffic and errors", traffic),
                Section(103, "TTFT SLO and error budgets", slo_panels),
                Section(104, "Latency and throughput", latency), Section(105, "Latency distributions", distributions)]
    return dashboard(UID, "Appliance / Service & SLOs",
                     "Is the service meeting its SLOs? Traffic, errors, latency percentiles and burn rates.",
                     sections, ["slo"], sel)
