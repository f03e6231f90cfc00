"""Every store keeps the store contract (appliance/batch/store.py): a line's result is recorded once, status
changes are guarded, each tenant reads only its own, pages follow a cursor. Each test runs on SQLite and on a real
PostgreSQL (tests/batch/postgres_server.py)."""

from __future__ import annotations

import pytest

from appliance.batch.model import (
    ERROR,
    OUTPUT,
    BatchRecord,
    FileRecord,
    LineInput,
    LineResult,
    Status,
    Usage,
)
from appliance.batch.sqlite import SQLiteBatchStore
from tests.batch.conftest import postgres_store


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    if request.param == "sqlite":
        store = SQLiteBatchStore(tmp_path / "batch.sqlite3")
    else:
        store = postgres_store(request.getfixturevalue("postgres"))
    yield store
    store.close()


def batch(batch_id: str = "batch_1", tenant: str = "team-a", status: Status = Status.IN_PROGRESS) -> BatchRecord:
    return BatchRecord(batch_id, tenant, "/v1/chat/completions", "file-in", "24h", status, created_at=100,
                       expires_at=100 + 86400)


def lines(count: int) -> list[LineInput]:
    return [LineInput(i, f"c{i}", '{"messages":[]}') for i in range(1, count + 1)]


def test_a_result_is_recorded_once_with_its_counts(store):
    store.create_batch(batch(), lines(3))
    result = LineResult(OUTPUT, '{"custom_id":"c1"}', Usage(10, 3, 2))
    assert store.record_results("batch_1", [(1, result)]) == [1]
    assert store.record_results("batch_1", [(1, LineResult(ERROR, '{"again":true}'))]) == []  # answered already
    record = store.get_batch("batch_1", None)
    assert (record.total, record.completed, record.failed, record.pending) == (3, 1, 0, 2)
    assert record.usage == Usage(10, 3, 2)
    assert store.results("batch_1", OUTPUT) == ['{"custom_id":"c1"}']
    assert store.results("batch_1", ERROR) == []


def test_malformed_lines_are_failed_when_the_batch_is_created(store):
    bad = LineInput(2, None, None, LineResult(ERROR, '{"error":"bad"}'))
    store.create_batch(batch(), [LineInput(1, "c1", "{}"), bad])
    record = store.get_batch("batch_1", "team-a")
    assert (record.total, record.failed, record.pending) == (2, 1, 1)
    assert [line.index for line in store.pending_lines("batch_1", now=0, exclude=(), limit=None)] == [1]


def test_pending_lines_in_order_without_those_in_flight_or_waiting_for_a_retry(store):
    store.create_batch(batch(), lines(5))
    store.defer_line("batch_1", 2, attempts=1, not_before=50.0)
    pending = store.pending_lines("batch_1", now=10.0, exclude={3}, limit=None)
    assert [line.index for line in pending] == [1, 4, 5]
    assert [line.index for line in store.pending_lines("batch_1", now=60.0, exclude=(), limit=2)] == [1, 2]
    assert store.pending_lines("batch_1", now=60.0, exclude=(), limit=None)[1].attempts == 1


def test_transitions_are_guarded(store):
    store.create_batch(batch(status=Status.VALIDATING), lines(1))
    moved = store.transition("batch_1", Status.IN_PROGRESS, 101, sources={Status.VALIDATING})
    assert moved.status is Status.IN_PROGRESS and moved.times == {"in_progress": 101}
    assert store.transition("batch_1", Status.IN_PROGRESS, 102, sources={Status.VALIDATING}) is None
    cancelling = store.transition("batch_1", Status.CANCELLING, 103, sources={Status.IN_PROGRESS},
                                  outcome=Status.CANCELLED)
    assert cancelling.outcome is Status.CANCELLED
    assert store.transition("batch_1", Status.FINALIZING, 104, sources={Status.IN_PROGRESS}) is None


def test_finish_records_the_files_and_drops_the_lines_once(store):
    store.create_batch(batch(status=Status.FINALIZING), lines(2))
    output = FileRecord("file-out", "team-a", "batch_output", "batch_1_output.jsonl", 10, 200)
    ended = store.finish("batch_1", Status.COMPLETED, 200, output=output, error=None)
    assert ended.status is Status.COMPLETED and ended.output_file_id == "file-out" and ended.error_file_id is None
    assert store.get_file("file-out", "team-a") == output
    assert store.pending_lines("batch_1", now=0, exclude=(), limit=None) == []  # in the files now
    assert store.finish("batch_1", Status.COMPLETED, 201, output=output, error=None) is None


def test_a_failed_batch_keeps_its_errors(store):
    store.create_batch(batch(), lines(2))
    failed = store.fail("batch_1", 150, [{"code": "tenant_removed", "message": "gone"}])
    assert failed.status is Status.FAILED and failed.errors == [{"code": "tenant_removed", "message": "gone"}]
    assert failed.times["failed"] == 150
    assert store.fail("batch_1", 151, []) is None
    assert [b.id for b in store.active_batches()] == []


def test_each_tenant_reads_only_its_own(store):
    store.add_file(FileRecord("file-a", "team-a", "batch", "a.jsonl", 1, 1))
    store.create_batch(batch("batch_a", "team-a"), lines(1))
    assert store.get_file("file-a", "team-b") is None and store.get_file("file-a", None) is not None
    assert store.get_batch("batch_a", "team-b") is None
    assert store.delete_file("file-a", "team-b") is None
    assert store.list_batches("team-b", status=None, after=None, limit=10) == []
    assert store.list_files("team-b", purpose=None, after=None, limit=10, newest_first=True) == []
    assert store.delete_file("file-a", "team-a") is not None and store.file_ids() == set()


def test_pages_follow_the_cursor(store):
    for i in range(5):
        store.add_file(FileRecord(f"file-{i}", "team-a", "batch", "x", 1, i))
        store.create_batch(batch(f"batch_{i}"), lines(1))
    newest = store.list_batches("team-a", status=None, after=None, limit=2)
    assert [b.id for b in newest] == ["batch_4", "batch_3"]
    assert [b.id for b in store.list_batches(None, status=None, after="batch_3", limit=10)] == [
        "batch_2", "batch_1", "batch_0"]
    assert [f.id for f in store.list_files("team-a", purpose="batch", after="file-1", limit=2,
                                           newest_first=False)] == ["file-2", "file-3"]
    assert store.list_batches(None, status=Status.COMPLETED, after=None, limit=10) == []
    assert [b.id for b in store.active_batches()] == [f"batch_{i}" for i in range(5)]  # oldest first


def test_the_summary_counts_batches_by_tenant_and_status(store):
    store.create_batch(batch("batch_1", "team-a"), lines(2))
    store.create_batch(batch("batch_2", "team-b", Status.VALIDATING), lines(1))
    summary = store.summary()
    assert summary.batches == {("team-a", "in_progress"): 1, ("team-b", "validating"): 1}
    assert [b.id for b in summary.active] == ["batch_1", "batch_2"]


def test_expired_files_are_the_old_ones_but_a_running_batchs_input(store):
    for i, created in enumerate((10, 20, 30, 40)):
        store.add_file(FileRecord(f"file-{i}", "team-a", "batch", "in.jsonl", 1, created))
    store.create_batch(BatchRecord("batch_1", "team-a", "/v1/chat/completions", "file-1", "24h",
                                   Status.IN_PROGRESS, created_at=20, expires_at=99), lines(1))
    store.create_batch(BatchRecord("batch_2", "team-a", "/v1/chat/completions", "file-2", "24h",
                                   Status.COMPLETED, created_at=30, expires_at=99), lines(1))
    assert [f.id for f in store.expired_files(30, limit=10)] == ["file-0", "file-2"]
    assert [f.id for f in store.expired_files(30, limit=1)] == ["file-0"]
    store.forget_files(["file-0", "file-2"])
    assert store.file_ids() == {"file-1", "file-3"}
    assert store.expired_files(30, limit=10) == []
