"""A batch on real vLLM engines, through the official ``openai`` client: upload, create, poll, download; every
line's answer is the one the same request gets when sent on its own (greedy decoding, temperature 0), and the
batch's counts and usage add up.

On the shared appliance (no API keys: every request is the ``default`` tenant's). Twenty short lines, so the
whole flow stays well under a minute on the CPU engines.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.engine

LINES = 20
ENDED = ("completed", "failed", "expired", "cancelled")


def request(i: int) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": f"Name a use of Python number {i}."}],
            "max_tokens": 12, "temperature": 0}


def test_a_batch_answers_each_line_as_the_request_alone_is_answered(appliance, client):
    data = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": request(i)}) + "\n" for i in range(LINES))
    uploaded = client.files.create(file=("eval.jsonl", data.encode()), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data.encode())
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "integration"})
    started = time.monotonic()
    while batch.status not in ENDED:
        assert time.monotonic() - started < 150, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    took = time.monotonic() - started
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (LINES,
                                                                                                        LINES, 0)
    assert batch.error_file_id is None and batch.metadata == {"suite": "integration"}
    rows = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in rows] == [f"line-{i}" for i in range(LINES)]
    completion_tokens = 0
    for i, row in enumerate(rows):
        assert row["response"]["status_code"] == 200 and row["error"] is None
        body = row["response"]["body"]
        alone = client.chat.completions.create(**request(i))
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content, f"line-{i}"
        assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens
        completion_tokens += body["usage"]["completion_tokens"]
    assert batch.usage.output_tokens == completion_tokens
    assert [b.id for b in client.batches.list(limit=5)][0] == batch.id
    print(f"\n{LINES} lines in {took:.1f}s (created to completed, polled every 0.5 s)")
