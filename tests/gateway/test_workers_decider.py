"""The decider and its workers over a real Unix socket, in one event loop: slots, the queue, cancellations,
quotas, records, and a worker that goes away. The invariant every test ends on: what the decider's admission
holds returns to nothing, and no replica is ever past its limit."""

from __future__ import annotations

import asyncio
import gc
import pickle
import random
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.observation.records import RequestRecord, RequestRecords
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import Cost, Quotas, Refusal
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.workers.decider import Decider
from appliance.gateway.workers.remote import DeciderClient, RemoteAdmission, RemoteLedger, RemoteQuotas, RemoteRecords
from appliance.http.errors import APIError
from tests.doubles import FakeReplica

A, B = Tenant("a"), Tenant("b", tokens_per_minute=100)
LIMIT = 2


class Watched(Router):
    """The router, checking on every slot it gives that no replica is past its limit."""

    peak: dict[str, int]

    def try_acquire(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        replica = super().try_acquire(*args, **kwargs)
        if replica is not None:
            held = self.in_flight(replica.name)
            self.peak[replica.name] = max(self.peak.get(replica.name, 0), held)
            assert held <= LIMIT, f"{replica.name} holds {held} > {LIMIT}"
        return replica


class Setup:
    def __init__(self, tmp: Path, *, max_queue: int = 64, queue_timeout: float = 30.0) -> None:
        self.fleet = [FakeReplica("replica-0", "http://r0"), FakeReplica("replica-1", "http://r1")]
        limits = ConcurrencyLimits(lambda: AIMDLimit(LIMIT, LIMIT, LIMIT, target_seconds=1.0))
        self.router = Watched(lambda: self.fleet, limit_for=limits.limit_of)
        self.router.peak = {}
        self.admission = Admission(self.router, limits, max_queue=max_queue, queue_timeout_seconds=queue_timeout)
        self.quotas = Quotas([A, B])
        self.records = RequestRecords(16)
        self.decider = Decider(self.admission, self.quotas, Reconciliation(), self.records)
        self.decider.settings = pickle.dumps({"hello": "worker"})
        self.path = tmp / "decider.sock"

    async def worker(self, number: int) -> tuple[DeciderClient, RemoteAdmission]:
        client = await DeciderClient.connect(self.path, number)
        return client, RemoteAdmission(client.link, client.routing, queue_timeout_seconds=30)

    async def poll(self) -> None:
        """What the engine poller does after each poll: the audit, and the queue moved (a tenant's share window
        ends between two releases)."""
        while True:
            await asyncio.sleep(0.05)
            self.admission.on_poll()

    def idle(self) -> bool:
        return (self.router.in_flight() == 0 and self.admission.queue_length == 0
                and not self.admission.ledger.held and all(not s.leases for s in self.decider.sessions))


def run(scenario: Callable[[Setup], Awaitable[None]]) -> None:
    """``scenario`` against a decider listening on a fresh socket (in /tmp: a Unix socket's path must be short)."""
    async def main() -> None:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            made = Setup(Path(tmp))
            await made.decider.start(made.path)
            poller = asyncio.ensure_future(made.poll())
            try:
                await scenario(made)
            finally:
                poller.cancel()
                await made.decider.stop()
    asyncio.run(main())


async def until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_worker_joins_with_the_settings_and_the_fleet() -> None:
    async def scenario(setup: Setup) -> None:
        client, _ = await setup.worker(1)
        assert client.settings == {"hello": "worker"}
        assert [r.name for r in client.routing.replicas()] == ["replica-0", "replica-1"]
        assert client.routing.any_eligible() and not client.routing.any_eligible({"replica-0", "replica-1"})
        assert client.routing.replicas()[0].url == "http://r0"
        await client.close()
    run(scenario)


def test_a_slot_is_the_deciders_and_goes_back_when_released() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        request = RoutingRequest("hello there")
        lease = await admission.acquire(frozenset({"replica-1"}), request, tenant=A)
        assert lease.replica.name == "replica-0" and request.decision is not None
        assert setup.router.in_flight("replica-0") == 1
        lease.release(Outcome.SUCCESS, 0.1)
        await until(setup.idle)
        await client.close()
    run(scenario)


def test_a_first_token_reaches_the_deciders_prefill_count() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        lease = await admission.acquire(tenant=A)
        name = lease.replica.name
        assert setup.admission.tenant_prefilling("a", name) == 1
        assert lease.first_token()
        await until(lambda: setup.admission.tenant_prefilling("a", name) == 0)
        lease.release(Outcome.SUCCESS)
        await until(setup.idle)
        await client.close()
    run(scenario)


def test_a_lease_a_worker_dropped_unreleased_is_counted_and_given_back() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        lease = await admission.acquire(tenant=A)
        name = lease.replica.name
        del lease
        gc.collect()  # the garbage collector's backstop: as a leak in the request path would end
        await until(setup.idle)
        assert setup.admission.ledger.reclaimed[name] == 1
        await client.close()
    run(scenario)


def test_a_refusal_reaches_the_worker_as_the_same_error() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        with pytest.raises(APIError) as refused:
            await admission.acquire(frozenset({"replica-0", "replica-1"}), RoutingRequest("x"), tenant=A)
        assert refused.value.status == 503 and refused.value.code == "no_ready_replica"
        await client.close()
    run(scenario)


def test_a_request_cancelled_while_queued_leaves_the_queue() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        held = [await admission.acquire(tenant=A) for _ in range(2 * LIMIT)]
        queued = asyncio.ensure_future(admission.acquire(tenant=A))
        await until(lambda: setup.admission.queue_length == 1)
        queued.cancel()
        await until(lambda: setup.admission.queue_length == 0)
        for lease in held:
            lease.release(Outcome.SUCCESS)
        await until(setup.idle)
        await client.close()
    run(scenario)


def test_a_worker_that_goes_away_gives_back_what_it_held() -> None:
    async def scenario(setup: Setup) -> None:
        client, admission = await setup.worker(1)
        _held = [await admission.acquire(tenant=A) for _ in range(2 * LIMIT)]
        queued = asyncio.ensure_future(admission.acquire(tenant=A))
        await until(lambda: setup.admission.queue_length == 1)
        await client.close()
        await until(setup.idle)
        with pytest.raises(APIError) as gone:
            await queued
        assert gone.value.code == "decider_unavailable"
    run(scenario)


def test_quotas_are_the_deciders_buckets() -> None:
    async def scenario(setup: Setup) -> None:
        client, _ = await setup.worker(1)
        quotas = RemoteQuotas(client.link, 5, __import__("prometheus_client").CollectorRegistry())
        assert await quotas.reserve(A, Cost(10, 10)) is None  # no quota: no round trip
        held = await quotas.reserve(B, Cost(40, 40))
        assert held is not None and not isinstance(held, Refusal)
        refused = await quotas.reserve(B, Cost(40, 40))
        assert isinstance(refused, Refusal) and refused.limit == "tokens" and refused.retry_after > 0
        held.refund()
        await until(lambda: not any(s.reservations for s in setup.decider.sessions))
        assert not isinstance(await quotas.reserve(B, Cost(40, 40)), Refusal)
        await client.close()
    run(scenario)


def test_a_record_reaches_the_deciders_ring_whole() -> None:
    async def scenario(setup: Setup) -> None:
        client, _ = await setup.worker(1)
        record = RequestRecord(id="r1", route="chat", tenant="a", stream=True, arrived_at=1.0)
        record.status = 200
        RemoteRecords(client.link, True).add(record)
        await until(lambda: len(setup.records) == 1)
        assert setup.records.get("r1") == record.to_json()
        await client.close()
    run(scenario)


def test_charges_and_unseen_work_reach_the_deciders_reconciliation() -> None:
    """The worker's reports (with the sequences their engine finished) and its estimates of unseen work, charged
    to the tenant by the decider (there held for no rest: charged as estimated at once)."""
    async def scenario(setup: Setup) -> None:
        charges: list[tuple[str, int]] = []
        setup.decider.reconciliation.charge = lambda tenant, tokens: charges.append((tenant, tokens))
        client, _ = await setup.worker(1)
        ledger = RemoteLedger(client.link)
        ledger.charged("replica-0", 12, 5, finished=2)
        ledger.unseen("replica-0", "a", 2, 20, 7, 40)
        await until(lambda: bool(charges))
        assert charges == [("a", 17)]
        assert setup.decider.reconciliation.tenants["replica-0"] == [32, 12]
        assert setup.decider.reconciliation.finished["replica-0"] == [0, 2]
        await client.close()
    run(scenario)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_storm_of_two_workers_never_passes_a_limit_and_returns_to_idle(seed: int) -> None:
    """Two workers, each with many requests that acquire, hold, release with any outcome, or are cancelled while
    queued or as their slot is granted; one worker leaves mid-storm and joins again. Every slot the router gives
    is checked against the limit (``Watched``); at the end the decider holds nothing."""
    async def scenario(setup: Setup) -> None:
        rng = random.Random(seed)
        workers = [await setup.worker(1), await setup.worker(2)]
        outcomes = list(Outcome)

        async def one(admission: RemoteAdmission) -> None:
            try:
                lease = await admission.acquire(frozenset(rng.sample(["replica-0", "replica-1"], rng.randint(0, 1))),
                                                RoutingRequest(f"prompt {rng.random()}"), tenant=rng.choice([A, B]))
            except APIError:
                return
            outcome = Outcome.ABORTED  # cancelled while it holds the slot: the transport settles it so
            try:
                await asyncio.sleep(rng.random() * 0.01)
                outcome = rng.choice(outcomes)
            finally:
                lease.release(outcome, rng.random())

        async def storm(admission: RemoteAdmission, count: int) -> None:
            tasks = []
            for _ in range(count):
                tasks.append(asyncio.ensure_future(one(admission)))
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.random() * 0.003)
                    tasks[rng.randrange(len(tasks))].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        first = asyncio.ensure_future(storm(workers[0][1], 300))
        second = asyncio.ensure_future(storm(workers[1][1], 150))
        await asyncio.sleep(0.05)
        await workers[1][0].close()  # leaves mid-storm
        await second
        workers[1] = await setup.worker(2)
        await asyncio.gather(first, storm(workers[1][1], 150))
        await until(setup.idle)
        assert max(setup.router.peak.values()) == LIMIT  # the storm did fill the replicas
        for client, _ in workers:
            await client.close()
    run(scenario)
