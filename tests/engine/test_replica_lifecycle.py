"""The supervised replica's life cycle with a stand-in engine process: ready, crash, backoff, restart, the reset
after a stable run, giving up on a start that never turns healthy, and stopping that leaves no process.
(Spawn failures, squatters and stop's bounds are in test_replica.py.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import psutil

from appliance.engine.contract import ReplicaState
from appliance.engine.placement import Placement
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from tests.engine.support import FAKE_ENGINE, free_port, run, wait_for


def spec(tmp_path: Path, *args: str, start_timeout: float = 30.0) -> ReplicaSpec:
    port = free_port()
    return ReplicaSpec(index=0, port=port, command=[sys.executable, FAKE_ENGINE, str(port), *args], env={},
                       placement=Placement("cpu", cores=(0,)), log_path=tmp_path / "engine-0.log",
                       start_timeout_seconds=start_timeout, stop_timeout_seconds=1.0)


def test_ready_then_stop_leaves_no_process(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        replica = SupervisedReplica(spec(tmp_path))
        replica.start(session)
        await wait_for(lambda: replica.status.state is ReplicaState.READY)
        pid = replica.status.pid
        assert replica.routable and replica.status.starts == 1 and replica.status.load_seconds is not None
        await replica.stop()
        assert replica.status.state is ReplicaState.STOPPED and replica.status.pid is None
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    run(scenario)


async def crashed(session: aiohttp.ClientSession, tmp_path: Path, run_seconds: str, crashes: int,
                  **backoff: float) -> SupervisedReplica:
    """A started replica whose engine exits with code 3 after ``run_seconds`` up, once it has crashed
    ``crashes`` times."""
    replica = SupervisedReplica(spec(tmp_path, "--exit-after", run_seconds, "3"), **backoff)
    replica.start(session)
    await wait_for(lambda: replica.status.crashes >= crashes)
    return replica


def test_a_crash_backs_off_then_restarts_and_backoff_doubles(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        replica = await crashed(session, tmp_path, "0.3", 1, backoff_initial=0.2, backoff_max=30.0)
        assert replica.status.last_exit_code == 3
        assert replica._next_backoff() == 0.2  # first crash: the initial backoff
        await wait_for(lambda: replica.status.crashes >= 2)
        assert replica.status.restarts >= 1 and replica.status.starts >= 2
        assert replica._next_backoff() == 0.4  # crashed again soon after: twice as long
        await replica.stop()

    run(scenario)


def test_a_stable_run_resets_the_backoff(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        # It stays up longer than backoff_max before each crash: every crash counts as the first.
        replica = await crashed(session, tmp_path, "1.5", 2, backoff_initial=0.1, backoff_max=0.5)
        assert replica.status.consecutive_crashes == 1
        assert replica._next_backoff() == 0.1
        await replica.stop()

    run(scenario)


def test_a_start_that_never_turns_healthy_is_killed_and_counted_as_a_crash(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        never_healthy = spec(tmp_path, start_timeout=0.5)
        never_healthy.command = [sys.executable, "-c", "import time; time.sleep(60)"]
        replica = SupervisedReplica(never_healthy, backoff_initial=0.1, backoff_max=1.0)
        replica.start(session)
        await wait_for(lambda: replica.status.crashes >= 1)
        assert replica.status.state in (ReplicaState.BACKOFF, ReplicaState.STARTING)
        assert not replica.routable
        await replica.stop()

    run(scenario)


def test_a_start_that_prints_nothing_is_ended_at_the_silence_timeout_with_its_stacks(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        silent = spec(tmp_path)  # a start timeout of 30 s: only the silence check can end it this soon
        silent.start_silence_timeout_seconds = 1.0
        silent.command = [sys.executable, "-m", "appliance.engine.launch", "--",
                          sys.executable, "-c", "import time\ndef hang():\n    time.sleep(60)\nhang()"]
        replica = SupervisedReplica(silent, backoff_initial=0.1, backoff_max=1.0)
        replica.start(session)
        await wait_for(lambda: replica.status.crashes >= 1, timeout=15)
        await replica.stop()
        logged = silent.log_path.read_text()
        assert "no output 1s after its start; ending it" in logged
        assert "appliance.engine.launch" in logged and " in " in logged  # each process: state, wait channel
        assert "Fatal Python error: Aborted" in logged and "in hang" in logged  # the hung process's own stack

    run(scenario)


SERVER_WAITING_FOR_ITS_CORE = """
import subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c", "import time\\ndef core_hang():\\n    time.sleep(60)\\ncore_hang()"])
print("banner", flush=True)
def server_wait():
    core.wait()
    time.sleep(60)
server_wait()
"""


def test_a_start_that_never_turns_healthy_leaves_the_stacks_of_its_server_and_its_core(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        stuck = spec(tmp_path, start_timeout=2.0)  # a server waiting for an engine core that hangs
        stuck.command = [sys.executable, "-m", "appliance.engine.launch", "--",
                         sys.executable, "-c", SERVER_WAITING_FOR_ITS_CORE]
        replica = SupervisedReplica(stuck, backoff_initial=0.1, backoff_max=1.0)
        replica.start(session)
        await wait_for(lambda: replica.status.crashes >= 1, timeout=20)
        await replica.stop()
        logged = stuck.log_path.read_text()
        assert "not healthy after 2s; ending it" in logged
        assert logged.count("Fatal Python error: Aborted") >= 2  # the core's dump is not cut by the server's end
        assert "in core_hang" in logged and "in server_wait" in logged

    run(scenario)


def test_a_start_that_prints_is_left_to_the_start_timeout(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        loading = spec(tmp_path)  # prints its banner, then loads for longer than the silence timeout
        loading.start_silence_timeout_seconds = 0.3
        loading.command = [sys.executable, "-u", "-c", "import time; print('banner'); time.sleep(60)"]
        replica = SupervisedReplica(loading, backoff_initial=0.1, backoff_max=1.0)
        replica.start(session)
        await asyncio.sleep(2.0)
        assert replica.status.crashes == 0 and replica.status.state is ReplicaState.STARTING
        await replica.stop()

    run(scenario)


def test_drain_and_undrain(tmp_path: Path) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        replica = SupervisedReplica(spec(tmp_path))
        replica.start(session)
        await wait_for(lambda: replica.routable)
        replica.drain()
        assert replica.status.state is ReplicaState.DRAINING and not replica.routable
        replica.undrain()
        assert replica.routable
        await replica.stop()

    run(scenario)
