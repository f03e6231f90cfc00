"""The request record as a hook, without a transport: attempts with their decisions, migrations with where they
went, the response headers that name the record, and nothing done when the view is off."""

from __future__ import annotations

import time

from appliance.gateway.observation.recording import Recording
from appliance.gateway.observation.records import RequestRecords
from appliance.gateway.routing.request import Decision
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.hook import Block, End
from tests.gateway.upstream.support import begin, chain, exchange


def test_a_moved_stream_is_recorded_attempt_by_attempt() -> None:
    records = RequestRecords(10)
    ex = exchange({"prompt": "hi", "stream": True}, headers={"x-request-id": "req-1"})
    hooks = chain(ex, Recording(records).start(ex))
    ex.routing.decision = Decision("replica-0", 2.0, "outstanding", considered=["replica-0", "replica-1"])
    attempt = begin(ex, "replica-0")
    headers: dict[str, str] = {}
    hooks.responding(attempt, headers)
    assert headers == {"x-appliance-request-id": "req-1", "x-appliance-decided-by": "outstanding"}
    hooks.relayed(Block(b"data: x\n\n", b"data: x\n\n", time.monotonic(), 1))
    ex.end_attempt(Outcome.FAILURE, "migrated: connection", 5)
    begin(ex, "replica-1", "continuation")
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    record = records.get("req-1")
    assert record is not None
    assert [a["replica"] for a in record["attempts"]] == ["replica-0", "replica-1"]
    assert record["attempts"][0]["reason"] == "migrated: connection"
    assert record["migrations"] == [{"from_replica": "replica-0", "to_replica": "replica-1", "reason": "connection",
                                     "sent_tokens": 5, "outcome": "continued"}]
    assert record["status"] == 200 and record["ttft_seconds"] is not None


def test_a_continuation_that_found_no_replica_is_a_failed_migration() -> None:
    records = RequestRecords(10)
    ex = exchange({"prompt": "hi", "stream": True}, headers={"x-request-id": "req-2"})
    hooks = chain(ex, Recording(records).start(ex))
    begin(ex, "replica-0")
    ex.end_attempt(Outcome.FAILURE, "migrated: engine_error", 2)
    hooks.finished(End(502, Outcome.FAILURE, True, time.monotonic()))
    record = records.get("req-2")
    assert record is not None and record["migrations"][0]["outcome"] == "failed"


def test_capacity_zero_records_nothing_and_touches_no_request() -> None:
    ex = exchange({"prompt": "hi"})
    assert Recording(RequestRecords(0)).start(ex) is None
