"""What the PostgreSQL store adds to the store contract (test_store.py runs that on it): several gateways share it.
Lines are claimed so no two gateways hold one at once, a dead gateway's lines pass on after the lease, the schema
is created once however many gateways start, and the password stays out of every message. All on a real
PostgreSQL (tests/batch/postgres_server.py)."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from appliance.batch.model import ERROR, OUTPUT, BatchRecord, LineInput, LineResult, Status, Usage
from appliance.batch.postgres import SCHEMA_VERSION, PostgresBatchStore
from appliance.batch.service import BatchService, Storage
from appliance.batch.sql import SchemaError
from appliance.batch.store import StoreUnavailable
from appliance.context import context_of
from appliance.http.errors import APIError
from tests.batch.conftest import auth, chat_line, create, jsonl, postgres_store, result_lines, upload, wait_for
from tests.batch.postgres_server import PostgresServer
from tests.batch.test_runner import Harness
from tests.gateway.redis_server import free_port

CLAIM = 60.0


def batch(total_id: str = "batch_1") -> BatchRecord:
    return BatchRecord(total_id, "team-a", "/v1/chat/completions", "file-in", "24h", Status.IN_PROGRESS,
                       created_at=100, expires_at=100 + 86400)


def lines(count: int) -> list[LineInput]:
    return [LineInput(i, f"c{i}", '{"messages":[]}') for i in range(count)]


def answer(index: int) -> LineResult:
    return LineResult(OUTPUT, f'{{"custom_id":"c{index}"}}', Usage(1, 1, 0))


@pytest.fixture
def gateways(postgres: PostgresServer):
    """Two stores on one schema: what two gateway processes sharing the database hold."""
    first = postgres_store(postgres, claim_seconds=CLAIM)
    second = postgres_store(postgres, first.schema, claim_seconds=CLAIM)
    yield first, second
    first.close()
    second.close()


def indexes(found) -> list[int]:
    return [line.index for line in found]


def test_a_claimed_line_is_given_to_no_other_gateway_until_its_lease_ends(gateways):
    """The takeover: ``a`` claims lines and vanishes (its connection gone, its claims still in the table); ``b``
    is not given them while the lease runs, and is once it ran out; ``a``'s late answer then changes nothing."""
    a, b = gateways
    a.create_batch(batch(), lines(6))
    assert indexes(a.pending_lines("batch_1", now=1000.0, exclude=(), limit=3)) == [0, 1, 2]
    a._conn.close()  # died: no close(), nothing released
    assert indexes(b.pending_lines("batch_1", now=1000.0 + CLAIM - 1, exclude=(), limit=10)) == [3, 4, 5]
    assert b.pending_lines("batch_1", now=1000.0 + CLAIM - 1, exclude={3, 4, 5}, limit=10) == []
    assert indexes(b.pending_lines("batch_1", now=1000.0 + CLAIM, exclude={3, 4, 5}, limit=10)) == [0, 1, 2]
    assert b.record_results("batch_1", [(index, answer(index)) for index in range(6)]) == list(range(6))
    assert a.record_results("batch_1", [(0, LineResult(ERROR, '{"late":true}'))]) == []  # reconnects, writes nothing
    assert b.get_batch("batch_1", None).completed == 6 and b.results("batch_1", ERROR) == []


def test_a_closed_gateway_releases_its_claims_and_a_deferred_line_is_anyones(gateways):
    a, b = gateways
    a.create_batch(batch(), lines(3))
    assert indexes(a.pending_lines("batch_1", now=10.0, exclude=(), limit=2)) == [0, 1]
    a.defer_line("batch_1", 0, attempts=1, not_before=20.0)  # a retry: whoever has room at 20 takes it
    assert indexes(b.pending_lines("batch_1", now=20.0, exclude=(), limit=5)) == [0, 2]
    a.close()
    assert indexes(b.pending_lines("batch_1", now=20.0, exclude={0, 2}, limit=5)) == [1]
    # without a limit nothing is claimed: an ended batch closes every pending line, whoever holds it
    assert indexes(b.pending_lines("batch_1", now=20.0, exclude=(), limit=None)) == [0, 1, 2]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_gateways_claiming_one_batch_in_a_storm_hold_each_line_alone_and_record_it_once(gateways, seed):
    """Two gateways (two connections, two threads) take lines of one batch at random sizes, answer most, give
    some back (kept claimed: only their claimant takes them again), defer some (released to either), and answer
    some twice. At no moment does one gateway claim a line the other holds in flight; the batch ends with each
    line recorded exactly once and its counts equal to the lines."""
    total = 150
    gateways[0].create_batch(batch(), lines(total))
    holder: dict[int, int] = {}  # line -> the gateway holding it in flight
    recorded: list[int] = []
    guard = threading.Lock()
    clash: list[str] = []

    def run(number: int, store: PostgresBatchStore) -> None:
        rng = random.Random(seed * 100 + number)
        now = 1000.0
        for _ in range(2000):
            now += rng.random() * 0.01
            with guard:
                mine = {index for index, who in holder.items() if who == number}
            claimed = store.pending_lines("batch_1", now=now, exclude=mine, limit=rng.randint(1, 8))
            with guard:
                for line in claimed:
                    if holder.get(line.index, number) != number:
                        clash.append(f"gateway {number} claimed line {line.index} held by {holder[line.index]}")
                    holder[line.index] = number
            for line in claimed:
                roll = rng.random()
                with guard:
                    holder.pop(line.index, None)  # answered or given back: out of flight before the store hears
                if roll < 0.7:
                    done = store.record_results("batch_1", [(line.index, answer(line.index))])
                    if rng.random() < 0.2:  # the same answer again (a retry that raced, a resent line)
                        done += store.record_results("batch_1", [(line.index, answer(line.index))])
                    with guard:
                        recorded.extend(done)
                elif roll < 0.85:
                    store.defer_line("batch_1", line.index, attempts=1, not_before=now + rng.random() * 0.05)
            if store.get_batch("batch_1", None).pending == 0:
                return

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, number, store) for number, store in enumerate(gateways)]:
            future.result()
    assert clash == []
    assert sorted(recorded) == list(range(total))  # each line recorded once, by one of them
    record = gateways[1].get_batch("batch_1", None)
    assert (record.completed, record.failed, record.pending) == (total, 0, 0)
    assert record.usage == Usage(total, total, 0)
    outputs = gateways[1].results("batch_1", OUTPUT)
    assert outputs == [f'{{"custom_id":"c{index}"}}' for index in range(total)]
    assert gateways[0].transition("batch_1", Status.FINALIZING, 2000, sources={Status.IN_PROGRESS},
                                  outcome=Status.COMPLETED) is not None
    assert gateways[1].transition("batch_1", Status.FINALIZING, 2000, sources={Status.IN_PROGRESS}) is None


def test_gateways_starting_together_create_the_schema_once_and_a_newer_one_is_refused(postgres):
    schema = "test_started_together"
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: postgres_store(postgres, schema), range(4)))
    for store in stores:
        store.close()
    store = postgres_store(postgres, schema)
    with store._tx() as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    store.close()
    with pytest.raises(SchemaError, match="newer"):
        postgres_store(postgres, schema)


def test_the_password_is_in_no_message_and_an_unreachable_database_is_a_503(postgres):
    with pytest.raises(StoreUnavailable) as refused:
        PostgresBatchStore(postgres.url, password="not-the-password", schema="test_refused")
    assert "not-the-password" not in str(refused.value) and "password authentication failed" in str(refused.value)
    gone = f"postgresql://appliance@127.0.0.1:{free_port()}/postgres"
    with pytest.raises(StoreUnavailable) as unreachable:
        PostgresBatchStore(gone, password=postgres.password, connect_timeout_seconds=1)
    assert postgres.password not in str(unreachable.value) and "127.0.0.1" in str(unreachable.value)

    storage = Storage(lambda: PostgresBatchStore(gone, password=postgres.password, connect_timeout_seconds=1),
                      postgres.directory / "files")
    assert storage.exists()  # a server database: nothing to create first
    with pytest.raises(APIError) as answered:
        asyncio.run(storage.call(lambda store, _: store.file_ids()))
    storage.close()
    assert answered.value.status == 503 and answered.value.code == "batch_store_unavailable"
    assert answered.value.headers["Retry-After"] == "5" and "127.0.0.1" not in answered.value.message


def test_of_gateways_moving_one_batch_at_once_exactly_one_wins(postgres):
    """Each gateway's runner advances every batch: four at once move the same batch, and one move happens."""
    schema = f"test_race_{random.randrange(1 << 30)}"
    stores = [postgres_store(postgres, schema) for _ in range(4)]
    try:
        for round_ in range(20):
            stores[0].create_batch(batch(f"batch_{round_}"), lines(1))
            start = threading.Barrier(len(stores))

            def move(store: PostgresBatchStore, batch_id: str = f"batch_{round_}",
                     start: threading.Barrier = start) -> bool:
                start.wait()
                return store.transition(batch_id, Status.CANCELLING, 200, sources={Status.IN_PROGRESS},
                                        outcome=Status.CANCELLED) is not None

            with ThreadPoolExecutor(len(stores)) as pool:
                assert sum(pool.map(move, stores)) == 1, f"round {round_}"
    finally:
        for store in stores:
            store.close()


def test_two_gateways_on_one_database_serve_and_run_the_same_batches(make_batch_client, postgres, tmp_path):
    """Two appliances' gateways (fake engines) with batch.database_url on one database and one files folder: a
    batch created through one is read, run and downloaded through the other, each line answered once in its file,
    and both gateways sent lines of it."""
    shared = {"database_url": postgres.url, "database_password_file": str(postgres.password_file),
              "database_schema": f"test_api_{random.randrange(1 << 30)}", "files_dir": str(tmp_path / "shared"),
              "max_concurrency": 1}
    first, second = make_batch_client(batch=shared), make_batch_client(batch=shared)
    uploaded = upload(first, jsonl([chat_line(f"l{i}") for i in range(120)])).json()
    created = create(first, uploaded["id"]).json()
    assert second.get(f"/v1/files/{uploaded['id']}", headers=auth("team-a")).status_code == 200
    ended = wait_for(second, created["id"], timeout=30)
    assert ended["status"] == "completed" and ended["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    assert sorted(line["custom_id"] for line in result_lines(second, ended["output_file_id"])) == sorted(
        f"l{i}" for i in range(120))
    sent = [context_of(client.app).registry.get_sample_value("appliance_batch_lines_answered_total",
                                                              {"tenant": "team-a", "result": "output"}) or 0.0
            for client in (first, second)]
    assert sum(sent) == 120 and min(sent) > 0, sent


def test_a_gateway_starting_leaves_another_gateways_fresh_file_in_the_shared_folder(postgres, tmp_path):
    """Another gateway wrote an upload and has not yet recorded it: this one's start must not take it for a crash's
    leftover; an old unrecorded file still is one."""
    fresh, old = "file-" + "1" * 24, "file-" + "2" * 24
    for name in (fresh, old):
        (tmp_path / name).write_bytes(b"{}\n")
    os.utime(tmp_path / old, (time.time() - 3600,) * 2)
    storage = Storage(lambda: postgres_store(postgres), tmp_path)
    try:
        assert asyncio.run(storage.call(lambda store, _: store.file_ids())) == set()
    finally:
        storage.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == [fresh]


def test_lines_one_gateway_gives_back_go_to_another_at_once(postgres, tmp_path):
    """Interactive traffic on gateway ``a`` preempts its batch lines: ``b``, idle, sends them at its next step
    instead of after ``a``'s claim (15 minutes by default) runs out."""
    schema = f"test_runners_{random.randrange(1 << 30)}"

    async def scenario() -> None:
        gateways = [Harness(tmp_path / name, max_concurrency=2) for name in "ab"]
        for gateway in gateways:
            gateway.storage = Storage(lambda: postgres_store(postgres, schema), tmp_path / "files")
            gateway.service = BatchService(gateway.settings, gateway.storage, served_model="demo",
                                           max_model_len=1024, clock=gateway.clock)
            gateway.runner = gateway.new_runner()
        a, b = gateways
        try:
            await a.batch(2)
            a.script.hang = {"team-a-0", "team-a-1"}
            await a.step()
            await b.step()
            assert sorted(a.script.sent) == ["team-a-0", "team-a-1"] and b.script.sent == []  # a holds both
            a.runner.preempt()
            while a.runner._tasks:
                await asyncio.sleep(0.001)
            await b.step()
            assert sorted(b.script.sent) == ["team-a-0", "team-a-1"]
        finally:
            for gateway in gateways:
                gateway.storage.close()

    asyncio.run(scenario())


def test_a_database_restart_fails_the_calls_it_cuts_and_the_next_ones_reconnect(postgres):
    store = postgres_store(postgres)
    try:
        store.create_batch(batch(), lines(2))
        postgres.restart()
        with pytest.raises(StoreUnavailable):  # the connection it held is gone: this call did nothing
            store.record_results("batch_1", [(0, answer(0))])
        assert store.record_results("batch_1", [(0, answer(0))]) == [0]  # a new connection, the data kept
        assert store.get_batch("batch_1", None).completed == 1
    finally:
        store.close()
