"""Kill the batch runner at any moment, start it again on the same database: every line of every batch is answered
exactly once in its batch's files, with the right answer, and the counts add up.

Two storms. In process, seeded: the storage "dies" at a drawn write (before it commits, or right after, so the
runner never hears it did), with a half-written temporary file left in the files folder; a new runner then resumes
on the same database, while the fake clock moves (some batches expire) and some batches are cancelled. Out of
process: the runner in a process of its own, SIGKILLed at random moments (a kill can land inside a transaction or
a file write), started again, until every batch has ended. The engine is a pure function of the line
(``storm.PureSubmitter``): a line sent again gives the same answer, and a line answered with another's shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from appliance.batch.blobs import FileBlobs
from appliance.batch.runner import BatchRunner
from appliance.batch.service import BatchService, Storage
from appliance.batch.settings import BatchSettings
from appliance.batch.sqlite import SQLiteBatchStore
from appliance.http.errors import APIError
from tests.batch.storm import PureSubmitter, check_batch, check_no_orphans, random_lines
from tests.doubles import FakeClock

SEED = 20260611
CASES = 30
WRITES = ("add_file", "create_batch", "transition", "finish", "fail", "record_results", "defer_line")
REPO = Path(__file__).resolve().parents[2]


class Killed(Exception):
    """The process died here."""


class Death:
    """When the storage dies: at its ``at``-th write (a store write or a file written), before the write or right
    after it; from then on every call fails, as nothing runs in a dead process."""

    def __init__(self, at: int, after: bool) -> None:
        self.at, self.after = at, after
        self.writes = 0
        self.dead = False

    def write(self, do, *args, **kwargs):
        if self.dead:
            raise Killed
        self.writes += 1
        if self.writes == self.at and not self.after:
            self.dead = True
            raise Killed
        result = do(*args, **kwargs)
        if self.writes == self.at:
            self.dead = True
            raise Killed
        return result


class MortalStore:
    def __init__(self, store: SQLiteBatchStore, death: Death) -> None:
        self._store, self._death = store, death

    def __getattr__(self, name: str):
        method = getattr(self._store, name)
        if name == "close":
            return method
        if name in WRITES:
            return lambda *args, **kwargs: self._death.write(method, *args, **kwargs)

        def read(*args, **kwargs):
            if self._death.dead:
                raise Killed
            return method(*args, **kwargs)

        return read


class MortalBlobs(FileBlobs):
    def __init__(self, folder: Path, death: Death) -> None:
        super().__init__(folder)
        self._death = death

    def write(self, file_id: str, data: bytes) -> None:
        def half_then_die() -> None:
            super(MortalBlobs, self).write(file_id, data)

        try:
            self._death.write(half_then_die)
        except Killed:
            (self.folder / f".{file_id}.12345.tmp").write_bytes(data[: len(data) // 2])  # a write cut short
            raise


async def _storm_case(tmp: Path, rng: random.Random) -> None:
    database, files = tmp / "batch.sqlite3", tmp / "files"
    settings = BatchSettings(max_concurrency=rng.randint(1, 6), backoff_seconds=0.001, max_attempts=3,
                             poll_seconds=0.001)
    clock = FakeClock(1_800_000_000.0)
    storage = Storage(database, files)
    service = BatchService(settings, storage, served_model="demo", max_model_len=1024, clock=clock)
    batches: dict[str, list[str]] = {}
    for number in range(rng.randint(1, 3)):
        lines = random_lines(rng, f"b{number}")
        data = ("\n".join(lines) + "\n").encode()
        file = await service.upload("team-a", "batch", "in.jsonl", data)
        created = await service.create("team-a", input_file_id=file["id"], endpoint="/v1/chat/completions",
                                       completion_window=rng.choice(["1h", "24h"]))
        batches[created["id"]] = lines
    storage.close()
    submitter = PureSubmitter(rng)
    for _round in range(40):
        last = _round == 39
        death = Death(at=10**9 if last else rng.randint(1, 25), after=rng.random() < 0.5)
        storage = Storage(database, files, open_store=lambda path, death=death: MortalStore(SQLiteBatchStore(path),
                                                                                          death))
        storage.blobs = MortalBlobs(files, death)
        runner = BatchRunner(settings, storage, submitter, _Idle(), tenant_known=lambda _name: True,
                             draining=lambda: False, clock=clock)
        service = BatchService(settings, storage, served_model="demo", max_model_len=1024, clock=clock)
        ended = False
        for _step in range(200):
            try:
                if rng.random() < 0.01:
                    with contextlib.suppress(APIError):  # 409: it ended already
                        await service.cancel(None, rng.choice(list(batches)))
                if rng.random() < 0.01:
                    clock.advance(3600)
                await runner.step()
                await asyncio.sleep(rng.choice([0, 0, 0.001, 0.003]))
                if death.dead:
                    break
                ended = not await storage.call(lambda store, _: store.active_batches())
            except Killed:
                break
            if ended:
                break
        await runner.stop(grace_seconds=1)
        storage.close()
        if ended:
            break
    else:
        raise AssertionError("the batches did not end in 40 lives")
    for batch_id, lines in batches.items():
        check_batch(database, files, batch_id, lines)
    check_no_orphans(database, files)


class _Idle:
    def idle_room(self) -> int:
        return 100


def test_a_runner_killed_at_any_write_resumes_and_answers_each_line_once(tmp_path):
    rng = random.Random(SEED)
    for case in range(CASES):
        folder = tmp_path / f"case-{case}"
        folder.mkdir()
        try:
            asyncio.run(_storm_case(folder, rng))
        except AssertionError as exc:
            raise AssertionError(f"case {case} (seed {SEED}): {exc}") from exc


# -- out of process: SIGKILL --------------------------------------------------------------------------------------

KILLS = 6


def test_a_runner_process_killed_at_random_moments_answers_each_line_once(tmp_path):
    rng = random.Random(SEED)
    database, files = tmp_path / "batch.sqlite3", tmp_path / "files"
    batches = asyncio.run(_create_batches(database, files, rng))
    worker = [sys.executable, "-m", "tests.batch.kill_worker", str(database), str(files)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for kill in range(KILLS + 1):
        process = subprocess.Popen([*worker, str(SEED + kill)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        if kill < KILLS:
            _wait_for_line(process, "running")
            time.sleep(rng.uniform(0.0, 0.4))
            process.send_signal(signal.SIGKILL)
            process.wait(10)
            continue
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output.decode()
    for batch_id, lines in batches.items():
        assert check_batch(database, files, batch_id, lines) == "completed"
    check_no_orphans(database, files)


def _wait_for_line(process: subprocess.Popen, text: str) -> None:
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    assert text in line, line


async def _create_batches(database: Path, files: Path, rng: random.Random) -> dict[str, list[str]]:
    storage = Storage(database, files)
    service = BatchService(BatchSettings(), storage, served_model="demo", max_model_len=1024)
    batches = {}
    for number in range(3):
        lines = random_lines(rng, f"k{number}") + [json.dumps({
            "custom_id": f"k{number}-extra-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}]}}) for i in range(20)]
        file = await service.upload("team-a", "batch", "in.jsonl", ("\n".join(lines) + "\n").encode())
        created = await service.create("team-a", input_file_id=file["id"], endpoint="/v1/chat/completions",
                                       completion_window="24h")
        batches[created["id"]] = lines
    storage.close()
    return batches
