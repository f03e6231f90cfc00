"""The batch runner: batch lines use idle capacity only and give it back at once.

Through the gateway (fake engines; what is verified is the gateway's own scheduling): no line is sent while the
replicas are busy up to their headroom, no more lines run than ``batch.max_concurrency`` or than each replica's
limit less ``batch.headroom_fraction``, and when an interactive request has to queue the lines in flight are given
back at once (``batch.preempt``), so the request waits for no batch work. Then the life cycle on the runner alone
(a scripted submitter, the fake clock): the completion window, a tenant that is gone, a spent quota, no idle
capacity, a drain, a disk that cannot take the results, and a restart in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from appliance.batch.model import ERROR, OUTPUT, PendingLine
from appliance.batch.runner import BatchRunner
from appliance.batch.service import BatchService, Storage
from appliance.batch.settings import BatchSettings
from appliance.batch.submit import Answer, Submission
from appliance.context import context_of
from appliance.gateway.routing.router import Outcome
from appliance.http.errors import APIError
from tests.batch.conftest import ADMIN, auth, chat_line, create, jsonl, result_lines, upload, wait_for
from tests.doubles import FakeClock
from tests.gateway.live import wait_until

# -- through the gateway --------------------------------------------------------------------------------------------


def test_no_line_is_sent_while_the_replicas_are_busy_to_their_headroom(make_batch_client, stubs):
    client = make_batch_client(admission={"max_limit": 2, "initial_limit": 2}, batch={"headroom_fraction": 0.5})
    admission = context_of(client.app).gateway.admission
    busy = [client.portal.call(admission.try_lease, frozenset({f"replica-{1 - i}"}), None) for i in range(2)]
    assert client.portal.call(admission.idle_room) == 0  # one request each: the other slot is headroom
    batch_id = create(client, upload(client, jsonl([chat_line("a"), chat_line("b")])).json()["id"]).json()["id"]
    wait_for(client, batch_id, statuses=("in_progress",))
    time.sleep(0.3)
    assert sum(len(stub.received) for stub in stubs) == 0
    for lease in busy:
        client.portal.call(lease.release, Outcome.SUCCESS)
    assert wait_for(client, batch_id)["request_counts"]["completed"] == 2


def test_lines_stay_within_each_replicas_headroom(make_batch_client, stubs):
    client = make_batch_client(admission={"max_limit": 4, "initial_limit": 4},
                               batch={"headroom_fraction": 0.5, "max_concurrency": 8})
    for stub in stubs:
        stub.first_token_delay = 0.1
    batch = _run(client, 16)
    assert batch["request_counts"]["completed"] == 16
    assert [stub.max_running for stub in stubs] == [2, 2]  # 4 x (1 - 0.5) each, though 8 were allowed


def test_lines_stay_within_the_concurrency_cap(make_batch_client, stubs):
    client = make_batch_client(batch={"max_concurrency": 1})
    for stub in stubs:
        stub.first_token_delay = 0.02
    assert _peak_running(stubs, lambda: _run(client, 6)) == 1


def _run(client, lines: int) -> dict:
    file_id = upload(client, jsonl([chat_line(f"l{i}") for i in range(lines)])).json()["id"]
    return wait_for(client, create(client, file_id).json()["id"])


def _peak_running(stubs, work) -> int:
    """The most requests the engines ran at once, all together, while ``work`` runs."""
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, int(sum(stub.running for stub in stubs)))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return peak


@pytest.mark.parametrize("preempt", [True, False])
def test_an_interactive_request_that_queues_takes_the_slots_of_batch_lines(make_batch_client, stubs, preempt):
    """One slot per replica, both held by batch lines that take a second each: an interactive request arrives and
    would queue. With preemption the lines are given back at once (the engines abort them) and the request waits
    for nothing; without, it waits for a line to end. Either way each line is answered once in the end."""
    client = make_batch_client(admission={"max_limit": 1, "initial_limit": 1, "queue_timeout_seconds": 10},
                               batch={"max_concurrency": 2, "headroom_fraction": 0.0, "preempt": preempt})
    for stub in stubs:
        stub.first_token_delay = 1.0
    batch_id = create(client, upload(client, jsonl([chat_line("b0"), chat_line("b1")])).json()["id"]).json()["id"]
    assert wait_until(lambda: all(stub.running == 1 for stub in stubs))
    response = client.post("/v1/chat/completions", headers={**auth("team-b"), "x-request-id": "interactive"},
                           json={"model": "demo", "messages": [{"role": "user", "content": "now"}]})
    assert response.status_code == 200
    record = client.get("/admin/requests/interactive", headers={"authorization": f"Bearer {ADMIN}"}).json()
    registry = context_of(client.app).registry
    preempted = registry.get_sample_value("appliance_batch_lines_given_back_total", {"reason": "preempted"})
    if preempt:
        assert record["queue_wait_seconds"] < 0.5
        assert preempted == 2 and sum(stub.aborted for stub in stubs) == 2
    else:
        assert record["queue_wait_seconds"] > 0.5
        assert preempted == 0 and sum(stub.aborted for stub in stubs) == 0
    batch = wait_for(client, batch_id)
    assert sorted(line["custom_id"] for line in result_lines(client, batch["output_file_id"])) == ["b0", "b1"]
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_an_interactive_request_holds_back_new_batch_lines(make_batch_client, stubs):
    """With ``batch.yield_seconds``, an interactive request's arrival holds back the next batch lines though the
    replicas are idle; they are sent when the hold ends."""
    client = make_batch_client(batch={"yield_seconds": 1.5, "max_yield_seconds": 1.5})
    response = client.post("/v1/chat/completions", headers=auth("team-b"),
                           json={"model": "demo", "messages": [{"role": "user", "content": "now"}]})
    assert response.status_code == 200
    held_from = time.monotonic()
    batch_id = create(client, upload(client, jsonl([chat_line("a"), chat_line("b")])).json()["id"]).json()["id"]
    wait_for(client, batch_id, statuses=("in_progress",))
    time.sleep(0.3)
    if time.monotonic() - held_from < 1.2:  # still within the hold (a slow host proves nothing here)
        assert sum(len(stub.received) for stub in stubs) == 1  # the interactive request only
    assert wait_for(client, batch_id)["request_counts"]["completed"] == 2
    assert time.monotonic() - held_from >= 1.5


def test_a_draining_appliance_gives_its_lines_back(make_batch_client, stubs):
    client = make_batch_client()
    for stub in stubs:
        stub.first_token_delay = 5.0
    create(client, upload(client, jsonl([chat_line("a")])).json()["id"])
    assert wait_until(lambda: sum(stub.running for stub in stubs) == 1)
    context_of(client.app).live.draining = True
    assert wait_until(lambda: sum(stub.aborted for stub in stubs) == 1, timeout=3)
    assert context_of(client.app).gateway.upstream.open_requests() == 0  # nothing left for the drain to wait for


# -- the runner alone -----------------------------------------------------------------------------------------------


class Script:
    """A submitter that answers every line 200 at once, except those told to hang (until given back) or to get
    another status."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.hang: set[str] = set()
        self.status: dict[str, Answer] = {}
        self.hanging = 0  # lines waiting to be given back now

    async def send(self, line: PendingLine, endpoint: str, tenant_name: str, submission: Submission) -> Answer:
        self.sent.append(line.custom_id)
        if line.custom_id in self.hang:
            self.hanging += 1
            try:
                await submission.receive()  # the client's side: returns when the runner gives the line back
            finally:
                self.hanging -= 1
            return Answer(499, b"")
        if line.custom_id in self.status:
            return self.status[line.custom_id]
        body = {"id": f"cmpl-{line.custom_id}", "choices": [{"message": {"content": line.custom_id}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
        return Answer(200, json.dumps(body).encode())


class Gate:
    def __init__(self, room: int = 100) -> None:
        self.room = room

    def idle_room(self) -> int:
        return self.room


class Harness:
    def __init__(self, tmp_path: Path, **settings: object) -> None:
        self.settings = BatchSettings(poll_seconds=0.01, backoff_seconds=0.01, **settings)
        self.clock = FakeClock(1_800_000_000.0)
        self.monotonic = FakeClock(100.0)
        self.storage = Storage(tmp_path / "batch.sqlite3", tmp_path / "files")
        self.service = BatchService(self.settings, self.storage, served_model="demo", max_model_len=1024,
                                    clock=self.clock)
        self.script, self.gate = Script(), Gate()
        self.tenants = {"team-a", "team-b"}
        self.draining = False
        self.runner = self.new_runner()

    def new_runner(self) -> BatchRunner:
        return BatchRunner(self.settings, self.storage, self.script, self.gate,
                           tenant_known=lambda name: name in self.tenants, draining=lambda: self.draining,
                           clock=self.clock, monotonic=self.monotonic)

    async def batch(self, count: int, tenant: str = "team-a", window: str = "24h") -> str:
        data = jsonl([chat_line(f"{tenant}-{i}") for i in range(count)])
        file = await self.service.upload(tenant, "batch", "in.jsonl", data)
        created = await self.service.create(tenant, input_file_id=file["id"], endpoint="/v1/chat/completions",
                                            completion_window=window)
        return str(created["id"])

    async def step(self) -> None:
        """One step, then every line it sent answered, but those that hang until given back."""
        await self.runner.step()
        await asyncio.sleep(0)
        while sum(not task.done() for task in self.runner._tasks) > self.script.hanging:
            await asyncio.sleep(0.001)

    async def get(self, batch_id: str) -> dict:
        return await self.service.batch(None, batch_id, operator=True)

    async def lines(self, batch: dict, kind: str) -> list[dict]:
        file_id = batch[f"{kind}_file_id"]
        if file_id is None:
            return []
        data = await self.service.content(batch["tenant"], file_id)
        return [json.loads(line) for line in data.decode().splitlines()]


def run(scenario) -> None:
    asyncio.run(scenario())


def test_a_batch_goes_through_its_life_cycle(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(3)
        assert (await h.get(batch_id))["status"] == "validating"
        await h.step()
        assert sorted(h.script.sent) == ["team-a-0", "team-a-1", "team-a-2"]
        assert (await h.get(batch_id))["status"] == "in_progress"
        h.clock.advance(5)
        await h.step()
        batch = await h.get(batch_id)
        assert batch["status"] == "completed" and batch["completed_at"] == batch["created_at"] + 5
        assert [line["custom_id"] for line in await h.lines(batch, OUTPUT)] == ["team-a-0", "team-a-1", "team-a-2"]
        assert batch["usage"]["input_tokens"] == 15 and batch["error_file_id"] is None

    run(scenario)


def test_past_its_window_a_batch_expires_with_what_is_done(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(4, window="1h")
        h.script.hang = {"team-a-2", "team-a-3"}
        await h.step()
        await h.step()
        assert len(h.runner._in_flight) == 2
        h.clock.advance(3600)
        await h.step()
        batch = await h.get(batch_id)
        assert batch["status"] == "expired" and batch["expired_at"] == batch["expires_at"]
        assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
        assert [line["custom_id"] for line in await h.lines(batch, OUTPUT)] == ["team-a-0", "team-a-1"]
        errors = await h.lines(batch, ERROR)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("team-a-2", "batch_expired"),
                                                                          ("team-a-3", "batch_expired")]
        await h.runner.stop()
        assert not h.runner._in_flight  # given back: the engine aborts them

    run(scenario)


def test_a_batch_whose_tenant_is_gone_fails(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(2)
        h.tenants.discard("team-a")
        await h.step()
        batch = await h.get(batch_id)
        assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "tenant_removed"
        assert h.script.sent == []

    run(scenario)


def test_a_spent_quota_holds_back_that_tenant_only(tmp_path):
    async def scenario():
        h = Harness(tmp_path, max_concurrency=1)
        quota = Answer(429, b'{"error": {}}', "rate_limit_exceeded", retry_after=30)
        a, b = await h.batch(2, "team-a"), await h.batch(2, "team-b")
        h.script.status["team-a-0"] = quota
        for _ in range(6):
            await h.step()
        assert (await h.get(b))["status"] == "completed"
        assert (await h.get(a))["request_counts"]["completed"] == 0  # waiting for its quota: not failed
        assert h.script.sent.count("team-a-0") == 1
        h.monotonic.advance(31)
        del h.script.status["team-a-0"]
        for _ in range(3):
            await h.step()
        assert (await h.get(a))["status"] == "completed"

    run(scenario)


def test_without_idle_capacity_or_while_draining_nothing_is_sent(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(2)
        h.gate.room = 0
        await h.step()
        h.draining, h.gate.room = True, 100
        await h.step()
        assert h.script.sent == []
        h.draining = False
        await h.step()
        await h.step()
        assert (await h.get(batch_id))["status"] == "completed"

    run(scenario)


def test_an_interactive_arrival_holds_back_new_lines_not_those_in_flight(tmp_path):
    """``batch.yield_seconds`` after an interactive request arrives, no new line is sent; a line already in flight
    goes on (it is not given back), and sending resumes when the hold ends, without waiting for the next poll."""

    async def scenario():
        h = Harness(tmp_path, yield_seconds=0.5, max_yield_seconds=2.0)
        h.settings.poll_seconds = 60.0
        batch_id = await h.batch(3)
        h.script.hang = {"team-a-0"}
        h.gate.room = 1
        await h.step()
        assert h.script.sent == ["team-a-0"]
        h.gate.room = 100
        h.runner.yield_to_interactive()
        h.monotonic.advance(0.3)
        h.runner.yield_to_interactive()  # a second arrival: held 0.5 s from it
        h.monotonic.advance(0.4)
        await h.step()
        assert h.script.sent == ["team-a-0"] and h.script.hanging == 1  # held, and the line in flight goes on
        h.runner.start()
        await asyncio.sleep(0.05)
        assert h.script.sent == ["team-a-0"]
        h.monotonic.advance(0.1)
        await asyncio.sleep(0.2)  # the hold's end wakes the runner, long before its 60 s poll
        assert sorted(h.script.sent) == ["team-a-0", "team-a-1", "team-a-2"]
        h.script.hang.clear()
        await h.runner.stop()
        assert (await h.get(batch_id))["request_counts"]["completed"] == 2

    run(scenario)


def test_arrivals_in_a_row_hold_lines_back_at_most_max_yield_seconds(tmp_path):
    """Interactive requests every 0.25 s, each holding new lines 0.5 s: after 1.5 s in a row lines are sent for
    0.5 s whatever arrives, then arrivals hold them again."""

    async def scenario():
        h = Harness(tmp_path, yield_seconds=0.5, max_yield_seconds=1.5, max_concurrency=1)
        await h.batch(10)
        sent_at: dict[int, float] = {}
        for _ in range(14):  # 0 .. 3.25 s
            h.runner.yield_to_interactive()
            await h.step()
            sent_at.setdefault(len(h.script.sent), h.monotonic() - 100.0)
            h.monotonic.advance(0.25)
        assert sent_at == {0: 0.0, 1: 1.5, 2: 1.75}  # held 1.5 s, open 0.5 s, held again from 2.0

    run(scenario)


def test_results_that_cannot_be_written_are_written_later(tmp_path, monkeypatch):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(1)
        await h.step()
        real = h.storage.blobs.write

        def full_disk(file_id: str, data: bytes) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(h.storage.blobs, "write", full_disk)
        await h.step()
        assert (await h.get(batch_id))["status"] == "finalizing"
        monkeypatch.setattr(h.storage.blobs, "write", real)
        await h.step()
        assert (await h.get(batch_id))["status"] == "completed"

    run(scenario)


def test_a_new_runner_resumes_where_the_last_one_stopped(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(4)
        h.script.hang = {"team-a-1", "team-a-3"}
        await h.step()
        await h.runner.stop()  # the appliance stops: lines in flight are given back, not answered
        assert (await h.get(batch_id))["request_counts"]["completed"] == 2
        h.script.hang = set()
        h.runner = h.new_runner()
        await h.step()
        await h.step()
        batch = await h.get(batch_id)
        assert batch["status"] == "completed"
        assert [line["custom_id"] for line in await h.lines(batch, OUTPUT)] == [f"team-a-{i}" for i in range(4)]

    run(scenario)


def test_a_cancelled_batch_gives_its_lines_back(tmp_path):
    async def scenario():
        h = Harness(tmp_path)
        batch_id = await h.batch(3)
        h.script.hang = {"team-a-1", "team-a-2"}
        await h.step()
        await h.service.cancel("team-a", batch_id)
        await h.step()
        batch = await h.get(batch_id)
        assert batch["status"] == "cancelled"
        assert [e["error"]["code"] for e in await h.lines(batch, ERROR)] == ["batch_cancelled"] * 2
        await asyncio.sleep(0.01)
        assert not h.runner._in_flight

    run(scenario)


def test_the_gateway_serves_the_openai_client(make_batch_client, stubs, tmp_path):
    """The official client's own calls (multipart upload, create, retrieve, download) against a real server."""
    import openai

    from appliance.app import create_app
    from tests.batch.conftest import KEYS, settings
    from tests.doubles import FakeReplica
    from tests.gateway.live import LiveGateway

    fleet = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    app = create_app(settings(tmp_path), replicas=lambda: fleet)
    with LiveGateway(app) as live:
        api = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["team-a"], max_retries=0,
                            http_client=httpx.Client(timeout=10))
        file = api.files.create(file=("in.jsonl", jsonl([chat_line("x"), chat_line("y")])), purpose="batch")
        batch = api.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 10
        while batch.status != "completed":
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
            batch = api.batches.retrieve(batch.id)
        assert batch.request_counts.completed == 2
        text = api.files.content(batch.output_file_id).text
        assert [json.loads(line)["custom_id"] for line in text.splitlines()] == ["x", "y"]
        assert [b.id for b in api.batches.list()] == [batch.id]
        with pytest.raises(openai.BadRequestError):
            api.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")


def test_files_past_their_retention_are_deleted_but_a_running_batchs_input(tmp_path):
    async def scenario():
        h = Harness(tmp_path, file_retention_hours=2)
        done_id = await h.batch(1)
        await h.step()
        await h.step()
        done = await h.get(done_id)
        assert done["status"] == "completed"
        stray = await h.service.upload("team-b", "batch", "later.jsonl", jsonl([chat_line("x")]))
        assert stray["expires_at"] == stray["created_at"] + 2 * 3600
        h.script.hang = {"team-a-0"}
        h.clock.advance(600)
        running_id = await h.batch(1)  # created 10 minutes after the others: expires 10 minutes later
        await h.step()
        running = await h.get(running_id)
        assert running["status"] == "in_progress"
        files = tmp_path / "files"
        kept = {done["input_file_id"], done["output_file_id"], stray["id"], running["input_file_id"]}
        assert {path.name for path in files.iterdir()} == kept

        h.clock.advance(2 * 3600 - 600)  # the first files are now exactly as old as their retention
        h.monotonic.advance(61)
        await h.step()
        assert {path.name for path in files.iterdir()} == {running["input_file_id"]}
        for tenant, file_id in (("team-a", done["output_file_id"]), ("team-b", stray["id"])):
            with pytest.raises(APIError) as gone:
                await h.service.file(tenant, file_id)
            assert gone.value.status == 404
        assert (await h.get(done_id))["status"] == "completed"  # the batch itself is kept

        h.clock.advance(3600)
        h.monotonic.advance(61)
        await h.step()  # the running batch's input outlives its retention while the batch runs
        assert {path.name for path in files.iterdir()} == {running["input_file_id"]}
        await h.runner.stop()

    run(scenario)


def test_a_retention_of_zero_keeps_files_until_deleted(tmp_path):
    async def scenario():
        h = Harness(tmp_path, file_retention_hours=0)
        uploaded = await h.service.upload("team-a", "batch", "in.jsonl", jsonl([chat_line("x")]))
        assert uploaded["expires_at"] is None
        h.clock.advance(10 * 365 * 86400)
        h.monotonic.advance(61)
        await h.step()
        assert (await h.service.file("team-a", uploaded["id"]))["id"] == uploaded["id"]

    run(scenario)
