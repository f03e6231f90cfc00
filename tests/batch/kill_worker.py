"""The batch runner alone in a process, for test_resume_storm.py to SIGKILL: runs every batch in the database to
its end with ``storm.PureSubmitter``, then exits 0. Prints "running" once it has opened the database."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from appliance.batch.runner import BatchRunner
from appliance.batch.service import Storage
from appliance.batch.settings import BatchSettings
from tests.batch.storm import PureSubmitter


class Idle:
    def idle_room(self) -> int:
        return 100


async def main(database: Path, files: Path, seed: int) -> None:
    settings = BatchSettings(max_concurrency=4, backoff_seconds=0.001, poll_seconds=0.001)
    storage = Storage(database, files)
    runner = BatchRunner(settings, storage, PureSubmitter(random.Random(seed), hang_rate=0.0), Idle(),
                         tenant_known=lambda _name: True, draining=lambda: False)
    await storage.call(lambda store, _: store.active_batches())
    print("running", flush=True)
    while await storage.call(lambda store, _: store.active_batches()):
        await runner.step()
        await asyncio.sleep(0.002)
    await runner.stop()
    storage.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
