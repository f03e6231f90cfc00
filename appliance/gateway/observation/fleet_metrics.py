"""The fleet's state as Prometheus metrics, read from the live objects when Prometheus scrapes.

Everything that is state (replica states, outstanding requests, limits, queue length, ejections) is read from the
router and admission at scrape time by a custom collector, so it can never drift from the truth. It sits above
both (the request-path metrics in ``metrics.py`` beside it sit below the router, which records into them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.engine.contract import Replica, ReplicaState
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Router

UNKNOWN_POLICY = "unknown"
SCHEDULING_POLICIES = ("priority", "fcfs", UNKNOWN_POLICY)  # appliance_replica_scheduling_policy's ``policy``


class FleetCollector(Collector):
    """Replica and admission state, read from the live objects at scrape time."""

    def __init__(self, router: Router, admission: Admission,
                 tenant_names: Callable[[], Iterable[str]] = lambda: (),
                 open_requests: Callable[[], int] = lambda: 0) -> None:
        self._router = router
        self._admission = admission
        self._open_requests = open_requests  # the proxy's count of requests it owes an answer
        self._tenant_names = tenant_names  # the configured tenants, read at each scrape (a reload changes them)

    def collect(self) -> Iterable[Metric]:
        replicas = list(self._router.replicas())
        state = GaugeMetricFamily("appliance_replica_state", "1 for the state each replica is in.",
                                  labels=["replica", "state"])
        outstanding = GaugeMetricFamily("appliance_replica_outstanding_requests",
                                        "Requests the gateway has in flight at each replica.", labels=["replica"])
        limit = GaugeMetricFamily("appliance_replica_concurrency_limit",
                                  "Adaptive concurrency limit of each replica (admission control).",
                                  labels=["replica"])
        ejected = GaugeMetricFamily("appliance_replica_ejected", "1 while a replica is ejected from routing.",
                                    labels=["replica"])
        ejections = CounterMetricFamily("appliance_replica_ejections", "Outlier ejections of each replica.",
                                        labels=["replica"])
        policy = GaugeMetricFamily("appliance_replica_scheduling_policy", "1 for the scheduling policy each "
                                   "replica's engine reported (priority: it takes the tenants' priority from the "
                                   "gateway; fcfs; unknown: an engine the appliance does not run, which gets no "
                                   "priority).", labels=["replica", "policy"])
        loads = self._router.loads()
        for replica in replicas:
            current = replica.status.state
            for candidate in ReplicaState:
                state.add_metric([replica.name, candidate.value], 1.0 if current is candidate else 0.0)
            outstanding.add_metric([replica.name], self._router.in_flight(replica.name))
            limit.add_metric([replica.name], self._admission.limit_of(replica.name))
            health = self._router.health_of(replica.name)
            ejected.add_metric([replica.name], 1.0 if health.ejected else 0.0)
            ejections.add_metric([replica.name], health.ejections)
            load = loads.get(replica.name)
            reported = (load.scheduling_policy if load is not None else None) or UNKNOWN_POLICY
            for named in SCHEDULING_POLICIES:
                policy.add_metric([replica.name, named], 1.0 if reported == named else 0.0)
        yield from (state, outstanding, limit, ejected, ejections, policy)
        yield GaugeMetricFamily("appliance_routing_panic",
                                "1 while too many replicas are ejected and routing ignores ejection "
                                "(routing.eject_panic_threshold).", value=1.0 if self._router.panic() else 0.0)
        yield GaugeMetricFamily("appliance_inflight_requests", "Requests in flight at the replicas.",
                                value=self._router.in_flight())
        yield GaugeMetricFamily("appliance_queue_length", "Requests waiting in the gateway's admission queue.",
                                value=self._admission.queue_length)
        yield GaugeMetricFamily("appliance_open_requests",
                                "Requests forwarded and not yet answered in full: queued, at a replica, or between "
                                "replicas (a stream's continuation waiting for one). What a SIGTERM's drain waits for.",
                                value=self._open_requests())
        yield from self._slot_audit(replicas)
        rejected = CounterMetricFamily("appliance_admission_rejections",
                                       "Requests answered 429 by admission control, by reason.", labels=["reason"])
        for reason, count in self._admission.rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        yield from self._tenants()

    def _tenants(self) -> Iterable[Metric]:
        """Each configured tenant's requests held at the replicas and waiting in the queue, 0 included (labels
        from the configuration only, never from a request)."""
        in_flight = GaugeMetricFamily("appliance_tenant_in_flight_requests",
                                      "Requests of each tenant in flight at the replicas.", labels=["tenant"])
        queued = GaugeMetricFamily("appliance_tenant_queued_requests",
                                   "Requests of each tenant waiting in the gateway's admission queue.",
                                   labels=["tenant"])
        for name in self._tenant_names():
            in_flight.add_metric([name], self._admission.tenant_in_flight(name))
            queued.add_metric([name], self._admission.tenant_queued(name))
        yield from (in_flight, queued)

    def _slot_audit(self, replicas: list[Replica]) -> Iterable[Metric]:
        """The slot invariant (appliance.gateway.slots): all 0 on a healthy gateway."""
        audit, ledger = self._admission.audit, self._admission.ledger
        surplus = GaugeMetricFamily(
            "appliance_slot_surplus", "Requests the gateway counts in flight at a replica beyond what its engine "
            "reported running + waiting at the last fresh reading.", labels=["replica"])
        drift = GaugeMetricFamily(
            "appliance_slot_drift", "1 while a replica's slot surplus has lasted admission.slot_drift_seconds.",
            labels=["replica"])
        reclaimed = CounterMetricFamily(
            "appliance_slot_leases_reclaimed", "Slot leases dropped without being released and returned by the "
            "garbage-collection backstop (a gateway bug if ever above 0).", labels=["replica"])
        orphans = CounterMetricFamily(
            "appliance_slot_orphans_returned", "Slots counted in flight with no lease holding them, returned by the "
            "audit (a gateway bug if ever above 0).", labels=["replica"])
        for replica in replicas:
            state = audit.drift.get(replica.name)
            surplus.add_metric([replica.name], state.surplus if state else 0)
            drift.add_metric([replica.name], 1.0 if audit.drifted(replica.name) else 0.0)
            reclaimed.add_metric([replica.name], ledger.reclaimed[replica.name])
            orphans.add_metric([replica.name], audit.orphans_returned[replica.name])
        yield from (surplus, drift, reclaimed, orphans)
