"""What the engine tests share: the stand-in engine process, a free port, and waiting in an event loop."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import aiohttp

FAKE_ENGINE = str(Path(__file__).parents[1] / "fake_engine.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def run(scenario) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)

    asyncio.run(main())
