"""SIGKILL of the whole appliance, at any moment: no engine process outlives it, and a batch it was running
resumes when it starts again, every line answered exactly once in the output file.

One appliance, one replica: the batch is submitted, the appliance is killed once some of its lines are answered and
others are not, then started again on the same state directory (its SQLite database and files)."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest

from tests.integration.harness import ApplianceProcess

pytestmark = pytest.mark.engine

LINES = 24
ENDED = ("completed", "failed", "expired", "cancelled")


def _batch_input() -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "demo", "prompt": f"Count to {i}:", "max_tokens": 24,
                                        "temperature": 0}}) + "\n"
                   for i in range(LINES)).encode()


def _client(app: ApplianceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _answered_some(client: openai.OpenAI, batch_id: str, timeout: float) -> int:
    """Wait until the batch has answered at least one line and not all: the moment to kill."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = client.batches.retrieve(batch_id).request_counts
        assert counts is not None
        if 0 < counts.completed < LINES:
            return counts.completed
        assert counts.completed < LINES, "the batch ended before the kill: too short to test a kill mid-batch"
        time.sleep(0.05)
    raise TimeoutError("no batch line answered in time")


def test_a_sigkilled_appliance_leaves_no_engine_and_resumes_its_batch(demo_model_int8, tmp_path):
    # Batch lines one at a time, so the batch lasts long enough to be killed half-way on any machine.
    env = {"APPLIANCE_BATCH__MAX_CONCURRENCY": "1"}
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path, replicas=1, env=env).start()
    try:
        app.wait_ready(timeout=300)
        engines = app.engine_processes()
        assert len(engines) >= 3  # launcher, vLLM API server, engine core
        client = _client(app)
        uploaded = client.files.create(file=("count.jsonl", _batch_input()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        answered = _answered_some(client, batch.id, timeout=240)
    finally:
        app.stop(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while app.leftover_engine_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert app.leftover_engine_processes() == []

    again = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path, replicas=1, env=env).start()
    try:
        again.wait_ready(timeout=300)
        client = _client(again)
        deadline = time.monotonic() + 300
        resumed = client.batches.retrieve(batch.id)
        while resumed.status not in ENDED:
            assert time.monotonic() < deadline, resumed
            time.sleep(0.5)
            resumed = client.batches.retrieve(batch.id)
        assert resumed.status == "completed", resumed
        assert resumed.request_counts is not None and resumed.request_counts.completed == LINES
        assert resumed.error_file_id is None and resumed.output_file_id is not None
        rows = [json.loads(line) for line in client.files.content(resumed.output_file_id).text.splitlines()]
        ids = [row["custom_id"] for row in rows]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES)), "each line answered exactly once"
        assert all(row["response"]["status_code"] == 200 for row in rows)
        print(f"\nkilled after {answered} of {LINES} lines; resumed and completed")
    finally:
        again.stop()
