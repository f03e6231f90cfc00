"""One worker process, started by the decider's pool (``appliance.gateway.workers.pool``):

    python -m appliance.serve_worker --decider SOCKET --http SOCKET --worker N --fd FD

It joins the decider (``--decider``), which sends the settings; builds its app (``composition.worker``); and
serves the clients' connections on the listening socket it inherited (``--fd``: the decider bound the port once,
so every worker accepts on the same socket and none can be outrun by another process on the port). Routes that
are not the OpenAI ones go to the decider's server (``--http``).

Signals do not stop it: the decider drains the whole gateway and tells its workers (``Drain``, ``Cut``), then
closes their link, and a worker whose link closes stops, ending its streams first. So SIGINT from a terminal,
which reaches the whole process group, drains once, from the decider. A second signal stops it at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from appliance.composition.worker import create_worker_app
from appliance.gateway.workers.remote import DeciderClient
from appliance.serve import server_options

log = logging.getLogger(__name__)


class WorkerServer(uvicorn.Server):
    """uvicorn's server, stopped by its decider rather than by signals (a second signal still stops it)."""

    def __init__(self, config: uvicorn.Config, client: DeciderClient) -> None:
        super().__init__(config)
        self.client = client
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            super().handle_exit(sig, frame)
            return
        self._signalled = True  # the decider drains the gateway and closes this worker's link

    async def stop_when_lost(self) -> None:
        """The decider closed the link (done, or gone): end the streams still running, then stop."""
        await self.client.lost.wait()
        if self.client.on_cut is not None:
            self.client.on_cut()
        self.should_exit = True


def inherited_listener(fd: int) -> socket.socket:
    """The clients' listening socket the decider passed down, as a socket object that knows its family from the fd.
    Not uvicorn's own ``fd`` option: it takes any fd for a Unix socket, and the event loop then treats the clients'
    TCP connections as Unix ones, without TCP_NODELAY, so Nagle's algorithm held small writes (first tokens) back
    until the client's delayed ACK, about 40 ms."""
    return socket.socket(fileno=fd)


async def run(decider: Path, http: Path, worker: int, fd: int) -> None:
    client = await DeciderClient.connect(decider, worker)
    settings = client.settings
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s worker {worker} %(levelname)s "
                        "%(name)s: %(message)s")
    app = create_worker_app(settings, client, http)
    config = uvicorn.Config(app, log_level=settings.log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=5, **server_options(settings))
    server = WorkerServer(config, client)
    watcher = asyncio.get_running_loop().create_task(server.stop_when_lost())
    listener = inherited_listener(fd)
    try:
        await server.serve(sockets=[listener])
    finally:
        watcher.cancel()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one gateway worker (started by appliance serve)")
    parser.add_argument("--decider", type=Path, required=True)
    parser.add_argument("--http", type=Path, required=True)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the server installs its own: the decider drains first
    loop_factory = uvicorn.Config("appliance").get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(args.decider, args.http, args.worker, args.fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
