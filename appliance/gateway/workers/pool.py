"""The decider's workers: started once the decider serves, restarted when one dies, stopped after the drain.

The pool binds the clients' port itself, once, and each worker inherits the listening socket: the port is the
appliance's from the start (a squatter makes ``appliance serve`` fail at once, not a worker later), and the kernel
hands each new connection to whichever worker accepts first, the least busy one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from appliance.gateway.workers.decider import Decider, WorkerSession
from appliance.gateway.workers.messages import Cut

log = logging.getLogger(__name__)

RESTART_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0)  # backoff between a worker's crashes in a row
STEADY_SECONDS = 30.0  # a worker that ran this long without dying is no longer crashing in a row
# How long the workers get to end once told to stop, before they are killed: the drain has already ended their
# streams, and a worker's own server then waits at most 5 s for its connections (timeout_graceful_shutdown); twice
# that leaves a busy host room, and bounds what a wedged worker can hold the shutdown (and the engines') for.
STOP_SECONDS = 10.0
# After SIGKILL a process ends as soon as the kernel runs it; one that does not within this is stuck in the kernel
# (uninterruptible I/O), where waiting longer would only hold the decider's shutdown, and the engines' after it.
REAP_SECONDS = 5.0


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The clients' port, bound once for every worker to accept on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class WorkerPool:
    def __init__(self, count: int, decider: Decider, decider_path: Path, http_path: Path,
                 listener: socket.socket, *, stop_seconds: float = STOP_SECONDS) -> None:
        """``stop_seconds``: the bound on ``stop``'s wait for the workers, after which they are killed."""
        self.count = count
        self.decider = decider
        self.decider_path = decider_path
        self.http_path = http_path
        self.listener = listener
        self.stop_seconds = stop_seconds
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The decider's socket first, then the workers (each joins it before it serves)."""
        await self.decider.start(self.decider_path)
        for number in range(1, self.count + 1):
            self._spawn(number)
        self._watch = asyncio.get_running_loop().create_task(self._keep())

    def _spawn(self, number: int) -> None:
        fd = self.listener.fileno()
        command = [sys.executable, "-m", "appliance.serve_worker", "--decider", str(self.decider_path),
                   "--http", str(self.http_path), "--worker", str(number), "--fd", str(fd)]
        self.processes[number] = subprocess.Popen(command, pass_fds=(fd,), env=os.environ.copy())
        log.info("gateway worker %d started, pid %d", number, self.processes[number].pid)

    async def _keep(self) -> None:
        """Restart a worker that died, with a backoff while it keeps dying (one that lived STEADY_SECONDS starts
        the backoff over)."""
        in_a_row = dict.fromkeys(self.processes, 0)
        started = dict.fromkeys(self.processes, time.monotonic())
        while not self._stopping:
            await asyncio.sleep(0.2)
            for number, process in list(self.processes.items()):
                code = process.poll()
                if code is None or self._stopping:
                    continue
                if time.monotonic() - started[number] > STEADY_SECONDS:
                    in_a_row[number] = 0
                wait = RESTART_SECONDS[min(in_a_row[number], len(RESTART_SECONDS) - 1)]
                log.error("gateway worker %d (pid %d) exited with %s; restarting it in %.1fs", number, process.pid,
                          code, wait)
                in_a_row[number] += 1
                await asyncio.sleep(wait)
                if self._stopping:
                    return
                self.restarts += 1
                self._spawn(number)
                started[number] = time.monotonic()

    def alive(self) -> int:
        return sum(1 for process in self.processes.values() if process.poll() is None)

    def drain(self) -> None:
        """The gateway drains: the workers answer new requests 503."""
        self.decider.drain()

    def cut(self) -> None:
        """The drain timed out: the workers end their streams with the shutting_down event."""
        self.decider.broadcast(Cut())

    async def stop(self) -> None:
        """Close every worker's link (each then stops, its streams ended), wait for them, kill what is left. The
        waits are bounded together by ``stop_seconds``: a worker that stopped reading its link (wedged, stopped,
        its socket's buffer full) would hold the link's drain, and with it the decider's shutdown, forever."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        deadline = time.monotonic() + self.stop_seconds
        await asyncio.gather(*(self._close(session, deadline) for session in list(self.decider.sessions)))
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for number, process in self.processes.items():
            if process.poll() is None:
                log.warning("gateway worker %d did not stop within %.0fs; killing it", number, self.stop_seconds)
                process.kill()
        await self._reap(time.monotonic() + REAP_SECONDS)

    async def _close(self, session: WorkerSession, deadline: float) -> None:
        """Close one worker's link once what was sent to it has left, or at ``deadline`` if it does not read: each
        link on its own, so that a wedged worker does not hold the others' stop."""
        try:
            await asyncio.wait_for(session.link.drain(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            log.warning("gateway worker %d did not read its link within %.0fs; closing it anyway", session.worker,
                        self.stop_seconds)
        except ConnectionError:
            pass  # the worker is gone already
        session.link.close()

    async def _reap(self, deadline: float) -> None:
        """Wait for every worker's exit (so none is left a zombie) without blocking the loop, until ``deadline``."""
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for number, process in self.processes.items():
            if process.poll() is None:
                log.error("gateway worker %d (pid %d) did not end after SIGKILL; leaving it", number, process.pid)
