"""The Batch API's metrics, in the gateway's registry: batches by status, each running batch's lines, how fast
lines are answered and how often batch work yields to interactive traffic.

Labels are bounded: ``tenant`` by the configuration, ``status``, ``state``, ``result`` and ``reason`` by fixed sets,
and ``batch`` only for batches not yet ended (read at scrape time from the runner's last reading of the store, so a
scrape never touches the database)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.batch.model import Status, Summary, Usage

GIVEN_BACK = ("preempted", "draining", "cancelled", "expired", "failed", "stopped")
DEFERRED = ("no_idle_capacity", "rate_limited", "unavailable", "server_error")


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry, summary: Callable[[], Summary],
                 in_flight: Callable[[], Mapping[str, int]]) -> None:
        self.answered = Counter("appliance_batch_lines_answered", "Batch lines answered, by tenant and the file "
                                "their result went to (output: 2xx; error: any other answer, or none when their "
                                "batch expired or was cancelled). Malformed lines, failed when their batch is "
                                "created, are not counted.", ["tenant", "result"], registry=registry)
        self.tokens = Counter("appliance_batch_tokens", "Tokens the engines reported for batch lines answered 2xx, "
                              "by tenant and kind (prompt, completion).", ["tenant", "kind"], registry=registry)
        self.given_back = Counter("appliance_batch_lines_given_back", "Batch lines in flight given back unanswered "
                                  "(the engine aborts them; they run again unless their batch ended), by why: "
                                  "preempted (an interactive request queued), draining, cancelled, expired, failed "
                                  "(the batch's tenant is gone), stopped.", ["reason"], registry=registry)
        self.deferred = Counter("appliance_batch_lines_deferred", "Batch lines that found no room and wait to run "
                                "later, by why: no_idle_capacity, rate_limited (the tenant's quota), unavailable "
                                "(no replica, draining), server_error (a retry after a 5xx).", ["reason"],
                                registry=registry)
        self.files_expired = Counter("appliance_batch_files_expired", "Files deleted because they outlived "
                                     "batch.file_retention_hours (uploads, output and error files).",
                                     registry=registry)
        for reason in GIVEN_BACK:
            self.given_back.labels(reason)
        for reason in DEFERRED:
            self.deferred.labels(reason)
        registry.register(BatchCollector(summary, in_flight))

    def answered_line(self, tenant: str, result: str, usage: Usage) -> None:
        self.answered.labels(tenant, result).inc()
        if usage.input_tokens or usage.output_tokens:
            self.tokens.labels(tenant, "prompt").inc(usage.input_tokens)
            self.tokens.labels(tenant, "completion").inc(usage.output_tokens)


class BatchCollector(Collector):
    """Read at scrape time from the runner's last summary of the store."""

    def __init__(self, summary: Callable[[], Summary], in_flight: Callable[[], Mapping[str, int]]) -> None:
        self._summary = summary
        self._in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        summary = self._summary()
        batches = GaugeMetricFamily("appliance_batches", "Batches stored, by tenant and status (every status of a "
                                    "tenant that has any batch).", labels=["tenant", "status"])
        for tenant in sorted({tenant for tenant, _ in summary.batches}):
            for status in Status:
                batches.add_metric([tenant, status.value], summary.batches.get((tenant, status.value), 0))
        yield batches
        lines = GaugeMetricFamily("appliance_batch_lines", "Lines of each batch not yet ended, by state: completed "
                                  "(answered 2xx), failed (in the error file), pending (to answer).",
                                  labels=["tenant", "batch", "state"])
        for batch in summary.active:
            for state, count in (("completed", batch.completed), ("failed", batch.failed),
                                 ("pending", batch.pending)):
                lines.add_metric([batch.tenant, batch.id, state], count)
        yield lines
        # The deadline, not the time left: it is exact however old the runner's reading is, and an alert can set
        # it against the batch's pending lines and their recent pace (time() - ...).
        expiry = GaugeMetricFamily("appliance_batch_expiry_timestamp_seconds", "Unix time at which each batch "
                                   "not yet ended expires (created_at + its completion_window): past it, the lines "
                                   "still pending are answered batch_expired.", labels=["tenant", "batch"])
        for batch in summary.active:
            expiry.add_metric([batch.tenant, batch.id], batch.expires_at)
        yield expiry
        in_flight = GaugeMetricFamily("appliance_batch_lines_in_flight", "Batch lines sent and not yet answered, by "
                                      "tenant.", labels=["tenant"])
        for tenant, count in sorted(self._in_flight().items()):
            in_flight.add_metric([tenant], count)
        yield in_flight
