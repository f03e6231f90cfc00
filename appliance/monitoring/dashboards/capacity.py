"""Appliance / Capacity: is there headroom? KV cache, queues, batching, preemptions, admission control, routing,
and the batches that run on what interactive traffic leaves."""

from __future__ import annotations

from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import Section, Selectors, dashboard, resolve
from appliance.monitoring.dashboards.panels import (
    RATE,
    heatmap,
    increase_by,
    rate,
    runbooks,
    stat,
    table,
    target,
    timeseries,
)

UID = "appliance-capacity"
KV_FULL, BACKLOG, SHEDDING, PREEMPTIONS = ("ApplianceKVCacheNearFull", "ApplianceQueueBacklog",
                                           "ApplianceLoadShedding", "AppliancePreemptionStorm")
KV_EVENTS_LOST, BATCH_WINDOW = "ApplianceKVEventsLost", "ApplianceBatchWindowMissed"
# Labels of vllm:cache_config_info (vLLM's CacheConfig as an info metric) that capacity planning reads.
CACHE_CONFIG_LABELS = "replica, model, cache_dtype, block_size, num_gpu_blocks, enable_prefix_caching"


def prefix_cache_hit_ratio(engine: str, *, by: str = "") -> str:
    """Prompt tokens found in vLLM's prefix cache over prompt tokens looked up; no sample while none were."""
    return (f"{rate('vllm:prefix_cache_hits_total', engine, by=by)} / "
            f"({rate('vllm:prefix_cache_queries_total', engine, by=by)} > 0)")


def routing_panels(gw: str, engine: str) -> list[dict[str, Any]]:
    """How the gateway's router decides (appliance/gateway/routing/): which scorer decided, whether prefix
    affinity pays off in the engines' prefix caches, what the index costs, and what routing costs per request."""
    match = "appliance_routing_prefix_match_ratio"
    duration = "appliance_routing_duration_seconds"
    return [
        timeseries(21, "Routing decisions by scorer",
                   target(rate("appliance_routing_decisions_total", gw, by="decided_by"), "{{decided_by}}"),
                   unit="ops", stack=True,
                   description="Routing decisions per second by what separated the chosen replica from the "
                               "runner-up: a scorer (outstanding, kv_cache, queue, prefix, cache_room), a "
                               "tie-breaker (tie_*), the balance bound (balance, tie_balance), nothing (index), a "
                               "single candidate (single), or round_robin."),
        timeseries(22, "Prefix match vs prefix cache hit",
                   target(f"histogram_quantile(0.5, sum by (le) (rate({match}_bucket{{{gw}}}[{RATE}])))",
                          "router prefix match p50"),
                   target(prefix_cache_hit_ratio(engine), "engine prefix cache hit"),
                   unit="percentunit", min_=0, max_=1,
                   description="Median share of each prompt whose prefix the router had recently sent to the "
                               "chosen replica, next to the share of prompt tokens the engines found in vLLM's "
                               "prefix cache: affinity that works shows up as cache hits."),
        timeseries(23, "Prefix index memory", target(f"appliance_routing_prefix_index_bytes{{{gw}}}", "{{instance}}"),
                   unit="bytes", w=8, min_=0,
                   description="Accounted memory of each gateway's prefix-affinity index; bounded by "
                               "routing.scorers.prefix.index_bytes, beyond which the least recently used blocks "
                               "are evicted."),
        timeseries(24, "Prefix affinity yields", target(rate("appliance_routing_prefix_yields_total", gw), "yields"),
                   unit="ops", w=8, min_=0,
                   description="Decisions per second where a replica holding the prompt's prefix was passed over "
                               "because it was over its bounded load (routing.scorers.prefix.load_factor)."),
        timeseries(25, "Routing time p99",
                   target(f"histogram_quantile(0.99, sum by (le) (rate({duration}_bucket{{{gw}}}[{RATE}])))", "p99"),
                   unit="s", w=8, min_=0,
                   description="99th percentile of the time the router took to choose a replica for one request "
                               "(filters, scorers, prompt hashing, index update); it adds to every TTFT."),
        heatmap(26, "Prefix match distribution", match, gw, unit="percentunit",
                description="Requests per prefix-match bucket: the share of the prompt recently sent to the chosen "
                            "replica (0 = a new prefix, 1 = all of it)."),
        heatmap(27, "Routing time distribution", duration, gw, unit="s",
                description="Requests per bucket of the router's decision time."),
    ]


def precise_routing_panels(config: MonitoringConfig, gw: str, gw_replica: str) -> list[dict[str, Any]]:
    """Precise prefix routing (routing.prefix_cache.mode precise or precise-with-fallback): where the prefix scores
    came from, and each replica's KV event index. In approximate mode these series do not exist: no data."""
    lost = runbooks(config, KV_EVENTS_LOST)
    return [
        timeseries(28, "Prefix score source",
                   target(rate("appliance_routing_prefix_source_total", gw, by="source"), "{{source}}"),
                   unit="ops", stack=True, links=lost,
                   description="Routing decisions per second by where the chosen replica's prefix score came from: "
                               "precise (its engine's KV events), approximate (the fallback of "
                               "precise-with-fallback), none (precise mode, the replica's cache unknown: no "
                               "affinity). Anything but precise is a decision made without the engines' word."),
        timeseries(29, "Precise fallbacks by reason",
                   target(rate("appliance_routing_precise_fallbacks_total", gw, by="reason"), "{{reason}}"),
                   target(rate("appliance_routing_prompts_untokenized_total", gw, by="reason"),
                          "untokenized {{reason}}"),
                   unit="ops", links=lost,
                   description="Replica scores per second that could not be precise: unknown_replica (its event "
                               "index is not current: lost events, a restart, a resync), no_tokens (the prompt was "
                               "not tokenized); and requests routed without their tokens, by why (busy: more than "
                               "routing.prefix_cache.max_pending_tokenizations at once)."),
        timeseries(30, "KV event index usable by replica",
                   target(f"appliance_routing_kv_index_usable{{{gw_replica}}}", "{{replica}} at {{instance}}"),
                   unit="none", w=8, min_=0, max_=1, links=lost,
                   description="1 while a gateway's index of the replica's cache is in step with its engine's KV "
                               "events and routed on; 0 while unknown (disconnected, events lost and being "
                               "resynced, the engine starting). 0 on a ready replica for long is "
                               "ApplianceKVEventsLost."),
        timeseries(31, "KV event batches lost",
                   increase_by("appliance_routing_kv_event_batches_lost_total", gw_replica, "replica", "lost"),
                   increase_by("appliance_routing_kv_index_resets_total", gw_replica, "replica, reason", "reset"),
                   unit="none", w=8, min_=0, links=lost,
                   description="Event batches missed for good per interval (gaps no replay filled, batches that "
                               "could not be decoded), and why each replica's index was emptied: restart, "
                               "publisher_restart, all_blocks_cleared and sync are the engine's own news; "
                               "replay_gap, replay_failed, undecodable and malformed are losses."),
        timeseries(32, "KV event lag",
                   target(f"max by (replica) (appliance_routing_kv_event_lag_seconds{{{gw_replica}}})",
                          "{{replica}}"),
                   unit="s", w=8, min_=0,
                   description="Delay of each replica's last event batch from its engine's publish to the "
                               "gateway's index (the slowest gateway; host clocks, so hosts must agree on the "
                               "time): a prefix cached less than this ago is not yet scored."),
    ]


def batch_panels(config: MonitoringConfig, gw: str) -> list[dict[str, Any]]:
    """The Batch API (docs/batch.md): batches and their lines, and how the idle capacity they run on comes and
    goes. Each gateway runs the batches of its own store: panels sum over gateways."""
    window = runbooks(config, BATCH_WINDOW)
    horizon = config.alerts.ApplianceBatchWindowMissed.horizon_seconds
    return [
        timeseries(33, "Batches by status", target(f"sum by (status) (appliance_batches{{{gw}}})", "{{status}}"),
                   unit="none", w=8, min_=0, links=window,
                   description="Batches stored, by status (validating, in_progress, finalizing, cancelling, and "
                               "the ended: completed, failed, cancelled, expired). A step in expired is a batch "
                               "that missed its completion window."),
        timeseries(34, "Batch lines pending and in flight",
                   target(f'sum by (tenant) (appliance_batch_lines{{{gw}, state="pending"}})', "pending {{tenant}}"),
                   target(f"sum by (tenant) (appliance_batch_lines_in_flight{{{gw}}})", "in flight {{tenant}}"),
                   unit="none", w=8, min_=0, links=window,
                   description="Lines of the batches not yet ended still to answer, per tenant, and those sent and "
                               "not yet answered: pending flat while none are in flight means no idle capacity."),
        timeseries(35, "Batch time left",
                   target(f"min by (tenant, batch) (appliance_batch_expiry_timestamp_seconds{{{gw}}}) - time()",
                          "{{tenant}} {{batch}}"),
                   unit="s", w=8, min_=0, thresholds=[(None, "orange"), (horizon, "green")], links=window,
                   description="Time until each batch not yet ended expires (its completion_window). Below the "
                               "dashed line, ApplianceBatchWindowMissed forecasts whether its pending lines can "
                               "still be answered at the pace of the last hour."),
        timeseries(36, "Batch lines answered by file",
                   target(rate("appliance_batch_lines_answered_total", gw, by="tenant, result"),
                          "{{tenant}} {{result}}"),
                   unit="ops", links=window,
                   description="Batch lines answered per second, per tenant and the file their result went to: "
                               "output (2xx) or error (any other answer, malformed lines aside, and the lines a "
                               "batch had not answered when it expired or was cancelled)."),
        timeseries(37, "Batch tokens by tenant",
                   target(rate("appliance_batch_tokens_total", gw, by="tenant, kind"), "{{tenant}} {{kind}}"),
                   unit="suffix: tok/s", stack=True,
                   description="Prompt and completion tokens per second of batch lines answered 2xx, per tenant: "
                               "the capacity batch work took (also counted in the tenants' own tokens)."),
        timeseries(38, "Batch lines deferred by reason",
                   target(rate("appliance_batch_lines_deferred_total", gw, by="reason"), "{{reason}}"),
                   unit="ops", links=window,
                   description="Batch lines per second that found no room and wait to run later: "
                               "no_idle_capacity (interactive traffic uses the headroom), rate_limited (the "
                               "tenant's quota), unavailable (no ready replica, a drain), server_error (a retry "
                               "after a 5xx)."),
        timeseries(39, "Batch lines given back by reason",
                   target(rate("appliance_batch_lines_given_back_total", gw, by="reason"), "{{reason}}"),
                   unit="ops",
                   description="Batch lines in flight given back unanswered per second (the engine aborts them; "
                               "they run again unless their batch ended): preempted (an interactive request "
                               "queued), draining, cancelled, expired, failed, stopped. Preempted work is "
                               "computed again."),
    ]


def build(config: MonitoringConfig | None = None) -> dict[str, Any]:
    config = resolve(config)
    sel = Selectors.of(config)
    gw, gw_replica, engine = sel.gateway, sel.gateway_replica, sel.engine
    knobs = config.alerts
    kv = f"vllm:kv_cache_usage_perc{{{engine}}}"
    now = [
        stat(1, "Max KV cache occupancy", target(f"max({kv})"), unit="percentunit", decimals=0,
             thresholds=[(None, "green"), (0.8, "orange"), (knobs.ApplianceKVCacheNearFull.threshold, "red")],
             links=runbooks(config, KV_FULL),
             description="Highest KV cache usage of any replica; near 100 % vLLM preempts running requests."),
        stat(2, "Gateway queue", target(f"appliance_queue_length{{{gw}}}"), unit="none",
             thresholds=[(None, "green"), (1, "orange"), (knobs.ApplianceQueueBacklog.threshold, "red")],
             links=runbooks(config, BACKLOG),
             description="Requests waiting in the gateway's admission queue right now."),
        stat(3, "In flight", target(f"appliance_inflight_requests{{{gw}}}"), unit="none",
             description="Requests the gateway has dispatched to replicas and not yet finished."),
        stat(4, "Engine waiting", target(f"sum(vllm:num_requests_waiting{{{engine}}})"), unit="none",
             thresholds=[(None, "green"), (1, "orange")],
             description="Requests queued inside the vLLM engines (should stay near 0: admission queues at the "
                         "gateway, where it is visible and bounded)."),
        stat(5, "429 rate", target(rate("appliance_admission_rejections_total", gw)), unit="reqps",
             thresholds=[(None, "green"), (0.01, "orange")], links=runbooks(config, SHEDDING),
             description="Requests per second rejected by admission control (queue full or queue timeout)."),
        stat(6, "Preemptions", target(rate("vllm:num_preemptions_total", engine)), unit="ops",
             thresholds=[(None, "green"), (0.01, "orange")], links=runbooks(config, PREEMPTIONS),
             description="vLLM preemptions per second, all replicas: the KV cache ran out and running requests "
                         "were evicted and will be recomputed."),
    ]
    kv_cache = [
        timeseries(7, "KV cache occupancy by replica", target(kv, "{{replica}}"), unit="percentunit", min_=0,
                   max_=1, thresholds=[(None, "green"), (knobs.ApplianceKVCacheNearFull.threshold, "red")],
                   links=runbooks(config, KV_FULL),
                   description="Fraction of each engine's KV cache blocks in use (vLLM's kv_cache_usage_perc); "
                               "the dashed line is ApplianceKVCacheNearFull's threshold."),
        timeseries(10, "Preemptions by replica",
                   target(rate("vllm:num_preemptions_total", engine, by="replica"), "{{replica}}"), unit="ops",
                   thresholds=[(None, "green"), (knobs.AppliancePreemptionStorm.threshold, "red")],
                   links=runbooks(config, PREEMPTIONS),
                   description="Preemptions per second per replica: sustained preemption means the KV cache is "
                               "too small for the admitted concurrency (dashed: AppliancePreemptionStorm)."),
        stat(19, "Prefix cache hit rate", target(prefix_cache_hit_ratio(engine)), unit="percentunit",
             decimals=1, w=6, h=8,
             description="Share of prompt tokens the selected engines found in vLLM's prefix cache over the "
                         "interval (all replicas together): prefill they did not have to compute."),
        timeseries(15, "Prefix cache hit ratio", target(prefix_cache_hit_ratio(engine, by="replica"), "{{replica}}"),
                   target(prefix_cache_hit_ratio(engine), "all replicas"),
                   unit="percentunit", min_=0, max_=1, w=18,
                   description="Share of prompt tokens served from vLLM's prefix cache (no prefill compute "
                               "needed), per replica and over all selected replicas; a gap means no prompt "
                               "was looked up. Recorded as *:vllm_prefix_cache_hit:ratio_rate5m."),
        table(20, "KV cache configuration", f"max by ({CACHE_CONFIG_LABELS}) (vllm:cache_config_info{{{engine}}})",
              hide=("Value",), w=24, h=5,
              description="Each replica's KV cache as its engine reports it (vllm:cache_config_info): the cache "
                          "dtype (auto = the model's dtype; fp8 halves the bytes per token and doubles the "
                          "blocks), the block size in tokens, the number of blocks, and whether prefix caching "
                          "is on."),
    ]
    queues = [
        timeseries(8, "Queue length: gateway and engines",
                   target(f"appliance_queue_length{{{gw}}}", "gateway"),
                   target(f"sum by (replica) (vllm:num_requests_waiting{{{engine}}})", "engine {{replica}}"),
                   unit="none", links=runbooks(config, BACKLOG),
                   description="Gateway admission queue versus each engine's own waiting queue."),
        timeseries(9, "Running vs waiting by replica",
                   target(f"sum by (replica) (vllm:num_requests_running{{{engine}}})", "running {{replica}}"),
                   target(f"sum by (replica) (vllm:num_requests_waiting{{{engine}}})", "waiting {{replica}}"),
                   unit="none", description="Requests in each engine's running batch and in its waiting queue "
                                            "(continuous batching: running is the batch size)."),
        timeseries(11, "Concurrency limit vs outstanding",
                   target(f"appliance_replica_concurrency_limit{{{gw_replica}}}", "limit {{replica}}"),
                   target(f"appliance_replica_outstanding_requests{{{gw_replica}}}", "outstanding {{replica}}"),
                   unit="none", description="Admission control's adaptive (AIMD) limit per replica and the "
                                            "requests in flight there; outstanding at the limit means queueing."),
        timeseries(12, "Admission rejections by reason",
                   target(rate("appliance_admission_rejections_total", gw, by="reason"), "{{reason}}"),
                   unit="reqps", links=runbooks(config, SHEDDING),
                   description="429s per second by reason: the queue was full, or a request waited longer than "
                               "the queue timeout."),
        timeseries(13, "In flight and queued", target(f"appliance_inflight_requests{{{gw}}}", "in flight"),
                   target(f"appliance_queue_length{{{gw}}}", "queued"), unit="none",
                   links=runbooks(config, BACKLOG),
                   description="Requests at the replicas and requests waiting at the gateway."),
        timeseries(16, "Outlier ejections",
                   target(f"appliance_replica_ejected{{{gw_replica}}}", "ejected {{replica}}"),
                   increase_by("appliance_replica_ejections_total", gw_replica, "replica", "ejections"),
                   target(f"appliance_routing_panic{{{gw}}}", "panic (ejection ignored)"),
                   unit="none", description="1 while the router has ejected a replica for slow or failing "
                                            "responses, and ejections per interval. Panic is 1 while so many "
                                            "are ejected (routing.eject_panic_threshold) that routing ignores "
                                            "ejection and uses every routable replica."),
    ]
    engines = [
        timeseries(14, "Generation throughput by replica",
                   target(rate("vllm:generation_tokens_total", engine, by="replica"), "out {{replica}}"),
                   target(rate("vllm:prompt_tokens_total", engine, by="replica"), "in {{replica}}"),
                   unit="suffix: tok/s", w=24,
                   description="Tokens per second each engine generated and prefilled."),
        heatmap(17, "Engine queue time distribution", "vllm:request_queue_time_seconds", engine, unit="s",
                description="Time requests spent in vLLM's waiting queue, per bucket; should stay in the lowest "
                            "buckets because admission control queues at the gateway."),
        heatmap(18, "Engine TTFT distribution", "vllm:time_to_first_token_seconds", engine, unit="s",
                description="Time to first token measured inside the engines, per bucket."),
    ]
    sections = [Section(101, "Headroom now", now), Section(102, "KV cache", kv_cache),
                Section(103, "Queues and admission", queues), Section(104, "Engines", engines),
                Section(105, "Routing", [*routing_panels(gw, engine), *precise_routing_panels(config, gw, gw_replica)]),
                Section(106, "Batches", batch_panels(config, gw))]
    return dashboard(UID, "Appliance / Capacity",
                     "Is there headroom? KV cache, queues, batching, preemptions and admission control.",
                     sections, ["capacity"], sel)
