"""What the resume storms share: a submitter whose answers are a pure function of the line (so a line answered
twice gives the same answer, and a wrong answer shows), batches of random lines, and the check that every line of
every batch is answered exactly once."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from appliance.batch.model import PendingLine, line_request_id
from appliance.batch.sqlite import SQLiteBatchStore
from appliance.batch.submit import Answer, Submission

MALFORMED = "{this line is not json"


def answer_body(custom_id: str) -> dict:
    return {"id": f"cmpl-{custom_id}", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer to {custom_id}"}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}


class PureSubmitter:
    """Answers each line 200 with ``answer_body``, after a random pause; some lines get a 500 first (tried again),
    some a 400 (their answer is an error), some wait until given back."""

    def __init__(self, rng: random.Random, *, fail_rate: float = 0.1, hang_rate: float = 0.05) -> None:
        self.rng = rng
        self.fail_rate = fail_rate
        self.hang_rate = hang_rate

    async def send(self, line: PendingLine, endpoint: str, tenant_name: str, submission: Submission) -> Answer:
        roll = self.rng.random()
        if roll < self.hang_rate:
            await submission.receive()
            return Answer(499, b"")
        await asyncio.sleep(self.rng.uniform(0, 0.003))
        if line.custom_id.endswith("-refused"):
            return Answer(400, b'{"error": {"message": "refused", "type": "BadRequestError"}}')
        if roll < self.hang_rate + self.fail_rate:
            return Answer(500, b'{"error": {"message": "engine failed"}}')
        return Answer(200, json.dumps(answer_body(line.custom_id)).encode())


def random_lines(rng: random.Random, prefix: str) -> list[str]:
    """1 to 14 lines: most good, some refused by the engine (400), some malformed."""
    lines = []
    for i in range(rng.randint(1, 14)):
        kind = rng.random()
        if kind < 0.08:
            lines.append(MALFORMED)
            continue
        custom_id = f"{prefix}-{i}" + ("-refused" if kind < 0.16 else "")
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "demo", "messages": [{"role": "user", "content": custom_id}]}}))
    return lines


def check_batch(database: Path, files: Path, batch_id: str, lines: list[str]) -> str:
    """Every line answered exactly once in the batch's files, the right answer for the right line, counts that
    add up; returns the batch's status."""
    store = SQLiteBatchStore(database)
    try:
        batch = store.get_batch(batch_id, None)
        assert batch is not None
        assert batch.status.value in ("completed", "cancelled", "expired"), batch
        results = {}
        for kind, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
            if file_id is None:
                results[kind] = []
                continue
            record = store.get_file(file_id, batch.tenant)
            data = (files / file_id).read_bytes()
            assert record is not None and record.bytes == len(data)
            results[kind] = [json.loads(row) for row in data.decode().splitlines()]
        answered = results["output"] + results["error"]
        ids = [row["id"] for row in answered]
        assert len(ids) == len(set(ids)), "a line answered twice"
        expected = {line_request_id(batch_id, number): line for number, line in enumerate(lines, start=1)}
        assert set(ids) == set(expected), "a line never answered"
        for row in results["output"]:
            assert row["response"]["body"] == answer_body(row["custom_id"]), row
            assert json.loads(expected[row["id"]])["custom_id"] == row["custom_id"]
        for row in results["error"]:
            if row["response"] is not None:
                assert row["custom_id"].endswith("-refused") or row["response"]["status_code"] == 500, row
            elif expected[row["id"]] == MALFORMED:
                assert row["error"]["code"] == "invalid_json"
            else:
                assert row["error"]["code"] == {"expired": "batch_expired",
                                                "cancelled": "batch_cancelled"}[batch.status.value], row
        assert (batch.total, batch.completed, batch.failed) == (len(lines), len(results["output"]),
                                                                len(results["error"]))
        assert store.pending_lines(batch_id, now=float("inf"), exclude=(), limit=None) == []
        return batch.status.value
    finally:
        store.close()


def check_no_orphans(database: Path, files: Path) -> None:
    store = SQLiteBatchStore(database)
    try:
        known = store.file_ids()
    finally:
        store.close()
    on_disk = {entry.name for entry in files.iterdir()}
    assert on_disk == known, f"unrecorded {on_disk - known}, missing {known - on_disk}"
