"""One engine replica: a vLLM server process, its health, and its life cycle.

A replica owns exactly one launcher process group (see ``appliance.engine.launch``). Its state is what the
gateway routes on and what /admin and the collectors report; they see it through ``appliance.engine.contract``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from appliance.engine.contract import ReplicaState, ReplicaStatus
from appliance.engine.environment import engine_base_env
from appliance.engine.health import HEALTH_PROBE_TIMEOUT_SECONDS, Health, HealthFailures, probe_health
from appliance.engine.identity import EngineUser
from appliance.engine.launch import GRACE_ENV, PARENT_ENV
from appliance.engine.logs import EngineLogPump
from appliance.engine.placement import Placement
from appliance.engine.ports import tree_listens_on
from appliance.engine.process_tree import abort_processes, describe_tree

log = logging.getLogger(__name__)

KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB, vLLM's CPU backend
FAULT_HANDLER_ENV = "PYTHONFAULTHANDLER"


@dataclass
class ReplicaSpec:
    """Everything needed to (re)start one replica; fixed for one engine process's life (a reload stages a new
    one, used from the next start on)."""

    index: int
    port: int
    command: list[str]
    env: dict[str, str]
    placement: Placement
    log_path: Path
    start_timeout_seconds: float
    stop_timeout_seconds: float
    host: str = "127.0.0.1"  # where the gateway reaches the engine: its bind address unless that is a wildcard
    log_max_bytes: int = 50_000_000  # log_path rotates at this size (see appliance.engine.logs)
    log_backups: int = 3  # rotated files kept
    log_stdout: bool = False  # engine lines also on the appliance's stdout, prefixed with the replica's name
    health_timeout_seconds: float = HEALTH_PROBE_TIMEOUT_SECONDS  # one /health probe's answer time
    user: EngineUser | None = None  # the engine's own user (engine.user); None: the appliance's
    start_silence_timeout_seconds: float = 120.0  # no output at all this long after the start: hung (0: off)

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SupervisedReplica:
    """Start, watch, restart and stop one engine process. Satisfies ``appliance.engine.contract.Replica``."""

    restartable = True
    drainable = True

    HEALTH_INTERVAL_SECONDS = 2.0
    HEALTH_FAILURES_UNHEALTHY = 3
    TERM_EXTRA_SECONDS = 5.0  # after SIGTERM: the engine's shutdown timeout plus this, then SIGKILL
    KILL_WAIT_SECONDS = 5.0  # after SIGKILL: how long stop() waits for the exit before it gives up on the process
    EXIT_POLL_SECONDS = 0.1  # how soon a dead engine leaves routing (a waitpid(WNOHANG) each time: cheap)
    ABORT_STEP_SECONDS = 1.0  # a hung start: from SIGABRT below the server to SIGABRT of the server
    ABORT_GRACE_SECONDS = 3.0  # a hung start: from the first SIGABRT (stacks into the log) to SIGKILL of the group
    OWNERSHIP_RECHECK_SECONDS = 30.0  # OK probes after one that proved the port ours check it again this often

    def __init__(self, spec: ReplicaSpec, *, backoff_initial: float = 1.0, backoff_max: float = 60.0) -> None:
        self.spec = spec
        self.status = ReplicaStatus()
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._proc: subprocess.Popen[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None
        self._staged: ReplicaSpec | None = None
        self._before_stage: ReplicaSpec | None = None  # the spec in use when the last stage() came
        self._pump: EngineLogPump | None = None
        self._aborted_at: float | None = None  # when a hung start was sent its first SIGABRT (None: it was not)
        self._aborted_server = False  # ... and its server too

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def placement(self) -> Placement:
        return self.spec.placement

    @property
    def kv_cache_space_bytes(self) -> int | None:
        space = self.spec.env.get(KV_CACHE_SPACE_ENV)
        return int(float(space) * 2**30) if space else None

    @property
    def routable(self) -> bool:
        return self.status.state is ReplicaState.READY

    def start(self, session: aiohttp.ClientSession) -> None:
        """Begin the replica's life cycle in the background: spawn, wait healthy, restart on crash."""
        self._session = session
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-lifecycle")

    async def stop(self) -> None:
        """Stop the engine gracefully (vLLM's --shutdown-timeout), then kill whatever is left of its group.

        Never blocks the event loop, and always ends STOPPED, even when the process does not go away (it is then
        logged and kept in ``last_error``): a replica stuck in STOPPING could never be restarted."""
        self._stopping = True
        self.status.state = ReplicaState.STOPPING
        try:
            await self._terminate()
        finally:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
            self.status.state = ReplicaState.STOPPED
            self.status.pid = None

    async def restart(self) -> None:
        """Stop and start again (maintenance); counted as a restart, not a crash."""
        assert self._session is not None, "restart() before start()"
        self.status.planned_restart = True
        await self.stop()
        self.status.restarts += 1
        self.start(self._session)

    def stage(self, spec: ReplicaSpec) -> None:
        """Use ``spec`` from the next start on (``appliance reload``); the running engine keeps its own."""
        if spec.port != self.spec.port or spec.index != self.spec.index:
            raise ValueError(f"{self.name}: a staged spec must keep index and port")
        self._staged = spec
        self._before_stage = self.spec

    def unstage(self) -> None:
        """Undo the last ``stage``: drop the staged spec if no start used it yet; if one did, start on the spec
        from before it next time (a crash restart must not bring back settings a reload gave up on)."""
        if self._staged is not None:
            self._staged = None
        elif self._before_stage is not None and self.spec is not self._before_stage:
            self._staged = self._before_stage
        self._before_stage = None

    @property
    def staged_spec(self) -> ReplicaSpec | None:
        """A reloaded configuration waiting for this replica's next start."""
        return self._staged

    def drain(self) -> None:
        """Take the replica out of routing; in-flight requests continue."""
        if self.status.state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            self.status.state = ReplicaState.DRAINING

    def undrain(self) -> None:
        if self.status.state is ReplicaState.DRAINING:
            self.status.state = ReplicaState.READY

    # -- life cycle -------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                self._spawn()
            except Exception as exc:  # noqa: BLE001 - ENOENT, ENOMEM, EACCES, ENOSPC on the log...: retry, never end
                self._record_spawn_failure(exc)
            else:
                code = await self._serve_until_exit()
                if self._stopping:
                    return
                self._record_crash(code)
            delay = self._next_backoff()
            log.error("%s: %s; restarting in %.1fs (log: %s)", self.name, self.status.last_error, delay,
                      self.spec.log_path)
            self.status.state = ReplicaState.BACKOFF
            await asyncio.sleep(delay)
            self.status.restarts += 1

    def _spawn(self) -> None:
        if self._staged is not None:
            self.spec, self._staged = self._staged, None
            log.info("%s: starting on the reloaded configuration", self.name)
        # An allow-listed environment, not the appliance's whole one: its secrets never reach an engine. Under a
        # user of its own (engine.user) it also runs with that user's uid, group and home, and no other group.
        user = self.spec.user
        env = {**engine_base_env(os.environ), **(user.env() if user else {}), **self.spec.env,
               PARENT_ENV: str(os.getpid()), GRACE_ENV: str(self.spec.stop_timeout_seconds),
               FAULT_HANDLER_ENV: "1"}  # a fatal signal (a hung start's SIGABRT) writes every thread's stack
        # Opens (creates) the log first: a log that cannot be written is a spawn failure, before any process.
        pump = EngineLogPump(self.name, self.spec.log_path, max_bytes=self.spec.log_max_bytes,
                             backups=self.spec.log_backups, stdout=sys.stdout if self.spec.log_stdout else None)
        pump.write(f"=== appliance: starting {self.name} ({self.spec.placement.describe()}) at {time.ctime()}")
        try:
            # A new session makes the launcher a process-group leader, so the group can be killed as a whole.
            self._proc = subprocess.Popen(
                self.spec.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, **(user.popen_options() if user else {}),
            )
        except BaseException:
            pump.close()
            raise
        assert self._proc.stdout is not None
        self._pump = pump
        try:
            pump.start(self._proc.stdout)
        except BaseException:  # no thread to empty the pipe: the engine would stall on it, so it must not run
            self._kill_group()
            self._proc.wait()
            self._proc = None
            self._pump = None
            pump.close()
            raise
        self.status.state = ReplicaState.STARTING
        self._aborted_at = None
        self.status.pid = self._proc.pid
        self.status.starts += 1
        self.status.last_start_time = time.time()
        log.info("%s starting, pid %d, port %d, %s", self.name, self._proc.pid, self.spec.port,
                 self.spec.placement.describe())

    async def _serve_until_exit(self) -> int:
        """Watch the process: mark it ready when /health turns green, unhealthy when it fails; return exit code."""
        assert self._proc is not None
        spawned = time.monotonic()
        failures = HealthFailures(self.status, self.spec.health_timeout_seconds + self.HEALTH_INTERVAL_SECONDS)
        owned_at: float | None = None  # when this process's tree last proved the port its own, OK probes since
        while True:
            code = self._proc.poll()
            if code is not None:
                self._kill_group()
                await self._close_log()
                return code
            assert self._session is not None
            health = await probe_health(self._session, self.url, self.spec.health_timeout_seconds)
            owned_at = await self._owns_port(owned_at) if health is Health.OK else None
            if health is Health.OK and owned_at is None:
                health = Health.FAILED
            counted = failures.record(health)
            state = self.status.state
            if health is Health.OK:
                if state is ReplicaState.STARTING:
                    self._mark_ready(time.monotonic() - spawned)
                elif state is ReplicaState.UNHEALTHY:
                    self.status.state = ReplicaState.READY
            else:
                if state is ReplicaState.READY and counted >= self.HEALTH_FAILURES_UNHEALTHY:
                    log.warning("%s failed %d health checks; not routing to it", self.name, counted)
                    self.status.state = ReplicaState.UNHEALTHY
                if state is ReplicaState.STARTING:
                    self._end_a_hung_start(time.monotonic() - spawned)
            await self._sleep_unless_exit(0.5 if self.status.state is ReplicaState.STARTING
                                          else self.HEALTH_INTERVAL_SECONDS)

    def _end_a_hung_start(self, elapsed: float) -> None:
        """End a start that will not end by itself: no /health within the start timeout, or not one line of
        output within the silence timeout (the process hangs before vLLM began: waiting for it to load a model
        it never started on would hold a rolling restart for the whole start timeout). The supervisor then
        starts it again, as after a crash.

        First SIGABRT, to the processes below the server (engine core, workers), then ABORT_STEP_SECONDS later to
        the server: engines run with PYTHONFAULTHANDLER, so each writes every thread's Python stack into its log
        as it dies, which says where it hung (the server goes last: when it dies, the launcher kills the rest of
        its group at once, dump written or not). ABORT_GRACE_SECONDS after the first, what is left is killed."""
        if self._aborted_at is not None:
            waited = time.monotonic() - self._aborted_at
            if waited > self.ABORT_GRACE_SECONDS:
                self._kill_group()
            elif waited > self.ABORT_STEP_SECONDS and not self._aborted_server:
                assert self._proc is not None
                self._aborted_server = True
                abort_processes(self._proc.pid, server=True)  # last: its death ends the launcher
            return
        silence = self.spec.start_silence_timeout_seconds
        if elapsed > self.spec.start_timeout_seconds:
            reason = f"not healthy after {self.spec.start_timeout_seconds:.0f}s"
        elif silence and elapsed > silence and self._pump is not None and self._pump.lines_read == 0:
            reason = f"no output {silence:.0f}s after its start"
        else:
            return
        assert self._proc is not None
        states = describe_tree(self._proc.pid)
        log.error("%s %s; ending it (%s)", self.name, reason, "; ".join(states))
        if self._pump is not None:
            self._pump.write(f"=== appliance: {reason}; ending it, its Python stacks follow. Its processes: "
                             + "; ".join(states))
        self._aborted_at, self._aborted_server = time.monotonic(), False
        abort_processes(self._proc.pid, server=False)  # the engine core and workers first

    async def _sleep_unless_exit(self, seconds: float) -> None:
        """Sleep between health probes, but notice the process's exit within EXIT_POLL_SECONDS: until then the
        gateway still routes to the replica's port, where by now anything (or anyone) may answer."""
        assert self._proc is not None
        deadline = time.monotonic() + seconds
        while self._proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(min(self.EXIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    async def _owns_port(self, owned_at: float | None) -> float | None:
        """After an OK probe: when this process's tree was last seen to hold the port (``owned_at`` when every probe
        since that check was OK and it is less than OWNERSHIP_RECHECK_SECONDS old, else now, checked again), or None
        when it does not hold it.

        Health turning OK (a start, a failed or late probe before) is always checked. In between, a proof is trusted
        for a while because the port cannot change hands unnoticed while the launcher lives: its server holds the
        listening socket until it dies, and then the launcher kills the rest of its group and exits, which
        ``poll()`` notices within EXIT_POLL_SECONDS (this loop ends with the process, and its proof with it). The
        check is cheap (appliance.engine.ports), but it runs beside the gateway's event loop, every
        HEALTH_INTERVAL_SECONDS per replica otherwise."""
        now = time.monotonic()
        if owned_at is not None and now - owned_at < self.OWNERSHIP_RECHECK_SECONDS:
            return owned_at
        return now if await self._answers_itself() else None

    async def _answers_itself(self) -> bool:
        """The 200 came from our own engine: its process tree listens on the port (see appliance.engine.ports)."""
        assert self._proc is not None
        owner = self.spec.user.uid if self.spec.user else None
        if await asyncio.to_thread(tree_listens_on, self._proc.pid, self.spec.port, owner_uid=owner):
            return True
        message = f"port {self.spec.port} answers /health, but not from this replica's processes"
        if self.status.last_error != message:
            log.warning("%s: %s; not routing to it", self.name, message)
            self.status.last_error = message
        return False

    def _mark_ready(self, load_seconds: float) -> None:
        if self.status.hold_when_ready:  # maintenance warms it first, then undrains it and ends the planned restart
            self.status.state = ReplicaState.DRAINING
        else:
            self.status.state = ReplicaState.READY
            self.status.planned_restart = False
        self.status.load_seconds = load_seconds
        self.status.last_ready_time = time.time()
        log.info("%s ready after %.1fs at %s", self.name, load_seconds, self.url)

    def _record_spawn_failure(self, exc: Exception) -> None:
        """The process could not even be started: counted apart from crashes, backed off like them."""
        self._proc = None
        self.status.pid = None
        self.status.spawn_failures += 1
        self.status.last_error = f"spawn failed: {type(exc).__name__}: {exc}"
        self.status.consecutive_crashes += 1

    def _record_crash(self, code: int) -> None:
        self.status.crashes += 1
        self.status.last_exit_code = code
        self.status.last_error = f"engine exited with {code}"
        stable_for = time.time() - (self.status.last_ready_time or 0)
        if self.status.last_ready_time and stable_for > self._backoff_max:
            self.status.consecutive_crashes = 0
        self.status.consecutive_crashes += 1

    def _next_backoff(self) -> float:
        exponent = self.status.consecutive_crashes - 1
        return min(self._backoff_max, self._backoff_initial * (2.0 ** exponent))

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                # Only the launcher: it forwards SIGTERM to the server, which shuts its engine core down in order.
                proc.send_signal(signal.SIGTERM)
                await self._wait_exit(proc, self.spec.stop_timeout_seconds + self.TERM_EXTRA_SECONDS)
            self._kill_group()
            if not await self._wait_exit(proc, self.KILL_WAIT_SECONDS):
                self.status.last_error = f"pid {proc.pid} did not exit after SIGKILL; left behind"
                log.error("%s: %s", self.name, self.status.last_error)
            self.status.last_exit_code = proc.returncode
        finally:
            self._proc = None
            await self._close_log()

    async def _close_log(self) -> None:
        """Let the pump write what the dead engine left in the pipe, then close its file (off the event loop:
        that waits for the pump's threads)."""
        pump, self._pump = self._pump, None
        if pump is not None:
            await asyncio.to_thread(pump.close)

    @staticmethod
    async def _wait_exit(proc: subprocess.Popen[bytes], seconds: float) -> bool:
        """Poll for the exit without blocking the event loop; True once it exited (and was reaped)."""
        deadline = time.monotonic() + seconds
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def _kill_group(self) -> None:
        """SIGKILL the launcher's whole process group: nothing of this replica may outlive it."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
