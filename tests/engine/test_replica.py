"""SupervisedReplica's life cycle against small stand-in processes (tests/fake_engine.py): spawn failures
are counted and retried, readiness needs the replica's own process on the port, stop always ends STOPPED."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from appliance.engine import replica as replica_module
from appliance.engine.contract import ReplicaState
from appliance.engine.health import Health
from appliance.engine.placement import Placement
from appliance.engine.ports import tree_listens_on
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from tests import fake_engine
from tests.fake_engine import FakeEngine

FAKE = str(Path(fake_engine.__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(port: int, *flags: str, launcher: bool = True) -> list[str]:
    command = [sys.executable, FAKE, str(port), *flags]
    return [sys.executable, "-m", "appliance.engine.launch", "--", *command] if launcher else command


def spec(tmp_path: Path, command: list[str], port: int, stop_timeout: float = 1.0) -> ReplicaSpec:
    return ReplicaSpec(index=0, port=port, command=command, env={"PYTHONPATH": str(Path.cwd())},
                       placement=Placement("cpu", cores=(0,)), log_path=tmp_path / "logs" / "engine-0.log",
                       start_timeout_seconds=60, stop_timeout_seconds=stop_timeout)


async def until(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def run(scenario: Callable[[aiohttp.ClientSession], object]) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)

    asyncio.run(main())


def test_a_failed_spawn_is_counted_retried_with_backoff_and_recovers(tmp_path):
    port = free_port()
    replica_spec = spec(tmp_path, ["/nonexistent/engine-binary"], port)
    replica = SupervisedReplica(replica_spec, backoff_initial=0.05, backoff_max=0.2)

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.spawn_failures >= 3)
        assert "No such file" in (replica.status.last_error or "")
        assert replica.status.state in (ReplicaState.BACKOFF, ReplicaState.STARTING)
        assert replica.status.starts == 0
        replica_spec.command = engine(port)  # the operator fixed it: the loop is still alive and picks it up
        await until(lambda: replica.status.state is ReplicaState.READY)
        await replica.stop()

    run(scenario)
    assert replica.status.state is ReplicaState.STOPPED


def test_a_log_that_cannot_be_written_is_a_counted_spawn_failure(tmp_path):
    port = free_port()
    (tmp_path / "not-a-dir").write_text("")
    replica_spec = spec(tmp_path, engine(port), port)
    replica_spec.log_path = tmp_path / "not-a-dir" / "engine-0.log"
    replica = SupervisedReplica(replica_spec, backoff_initial=0.05, backoff_max=0.1)

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.spawn_failures >= 2)
        await replica.stop()

    run(scenario)
    assert replica.status.last_error and "not-a-dir" in replica.status.last_error
    assert replica.status.state is ReplicaState.STOPPED


def test_a_squatter_on_the_port_does_not_make_a_dead_replica_ready(tmp_path):
    port = free_port()
    squatter = FakeEngine(port=port).start()  # another process's server on the replica's port: answers /health 200
    replica = SupervisedReplica(spec(tmp_path, engine(port, "--no-listen"), port))

    async def scenario(session):
        replica.start(session)
        await until(lambda: squatter.health_checks >= 4)  # the squatter answered 200 to several health probes...
        assert replica.status.state is ReplicaState.STARTING  # ...and the replica is still not ready
        await replica.stop()

    try:
        run(scenario)
    finally:
        squatter.stop()


def test_its_own_engine_on_the_port_makes_it_ready(tmp_path):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port), port))

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        assert tree_listens_on(replica.status.pid, port)  # via the launcher's child
        assert not tree_listens_on(replica.status.pid, free_port())
        await replica.stop()

    run(scenario)


class Probes:
    """The supervisor's health probes of a real engine, counted, with failures on demand; and its ownership checks
    (the real ones), counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.probes = self.checks = self.fail_next = 0
        real_probe, real_check = replica_module.probe_health, replica_module.tree_listens_on

        async def probe(*args: object, **kwargs: object) -> Health:
            health = await real_probe(*args, **kwargs)
            self.probes += 1
            if self.fail_next:
                self.fail_next -= 1
                return Health.FAILED
            return health

        def check(*args: object, **kwargs: object) -> bool:
            self.checks += 1
            return real_check(*args, **kwargs)

        monkeypatch.setattr(replica_module, "probe_health", probe)
        monkeypatch.setattr(replica_module, "tree_listens_on", check)

    async def more(self, count: int) -> None:
        """Wait for ``count`` more probes."""
        target = self.probes + count
        await until(lambda: self.probes >= target)


def test_ownership_is_proved_when_health_turns_ok_not_on_every_probe_while_ready(tmp_path, monkeypatch):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port), port))
    replica.HEALTH_INTERVAL_SECONDS = 0.02
    probes = Probes(monkeypatch)

    async def scenario(session):
        replica.start(session)
        try:
            await until(lambda: replica.status.state is ReplicaState.READY)
            await probes.more(20)
            assert probes.checks == 1  # proved once, when it turned OK; trusted on the next probes
            probes.fail_next = 10**6
            await until(lambda: replica.status.state is ReplicaState.UNHEALTHY)
            probes.fail_next = 0
            await until(lambda: replica.status.state is ReplicaState.READY)
            await probes.more(10)
            assert probes.checks == 2  # unhealthy -> OK: proved again
            probes.fail_next = 1  # one failed probe: still ready, but the next OK proves it again
            await probes.more(10)
            assert replica.status.state is ReplicaState.READY and probes.checks == 3
            replica.OWNERSHIP_RECHECK_SECONDS = 0.1
            await until(lambda: probes.checks >= 6)  # and while it stays ready, every OWNERSHIP_RECHECK_SECONDS
            assert probes.checks < probes.probes / 2
        finally:
            await replica.stop()

    run(scenario)


def test_a_recheck_that_finds_the_port_in_other_hands_takes_the_replica_out_of_routing(tmp_path, monkeypatch):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port), port))
    replica.HEALTH_INTERVAL_SECONDS = 0.02
    replica.OWNERSHIP_RECHECK_SECONDS = 0.5
    owned = True
    monkeypatch.setattr(replica_module, "tree_listens_on", lambda *args, **kwargs: owned)

    async def scenario(session):
        nonlocal owned
        replica.start(session)
        try:
            await until(lambda: replica.status.state is ReplicaState.READY)
            owned = False  # what a check would find if the socket were no longer the tree's
            await until(lambda: replica.status.state is ReplicaState.UNHEALTHY, 10)
            assert "not from this replica's processes" in (replica.status.last_error or "")
            owned = True
            await until(lambda: replica.status.state is ReplicaState.READY, 10)
        finally:
            await replica.stop()

    run(scenario)


def test_stop_never_blocks_the_loop_and_always_ends_stopped(tmp_path, monkeypatch):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port, "--ignore-term", launcher=False), port, stop_timeout=0))
    replica.TERM_EXTRA_SECONDS = 0.3
    replica.KILL_WAIT_SECONDS = 0.3
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    async def scenario(session):
        nonlocal ticks
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        pid = replica.status.pid
        monkeypatch.setattr(replica, "_kill_group", lambda: None)  # a process that SIGKILL does not end (D state)
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks = 0
        try:
            await asyncio.wait_for(replica.stop(), 30)
        finally:
            task.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        assert ticks >= 5  # the event loop kept running while stop() waited

    run(scenario)
    assert replica.status.state is ReplicaState.STOPPED
    assert "did not exit" in (replica.status.last_error or "")


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    # every test stops its replica; a leftover child would show here
    import psutil

    assert not [p for p in psutil.Process().children(recursive=True) if FAKE in " ".join(p.cmdline())]


def test_a_staged_spec_is_used_from_the_next_start_on(tmp_path):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port), port))

    def engine_cmdline() -> str:
        import psutil

        return " ".join(" ".join(p.cmdline()) for p in psutil.Process(replica.status.pid).children(recursive=True))

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        replica.stage(spec(tmp_path, engine(port, "--tag=reloaded"), port))
        assert replica.staged_spec and "--tag=reloaded" not in engine_cmdline()  # the running engine keeps its own
        await replica.restart()
        await until(lambda: replica.status.state is ReplicaState.READY)
        assert replica.staged_spec is None and "--tag=reloaded" in engine_cmdline()
        with pytest.raises(ValueError):
            replica.stage(spec(tmp_path, engine(port), port + 1))
        await replica.stop()

    run(scenario)


def test_supervisor_stage_rebuilds_every_command_from_the_settings(tmp_path):
    from appliance.composition.fleet import build_specs, build_supervisor
    from appliance.engine.supervisor import Supervisor
    from appliance.settings import Settings

    (tmp_path / "config.json").write_text("{}")  # a checkpoint: settings read its max_model_len
    settings = Settings(model=tmp_path, replicas=2, device="cpu", state_dir=tmp_path)
    supervisor = build_supervisor(settings, {"APPLIANCE_ENGINE_STATS_DIR": str(tmp_path)})
    supervisor.stage(settings.engine.model_copy(update={"max_num_seqs": 7}))
    for replica in supervisor.replicas:
        command = replica.staged_spec.command
        assert command[command.index("--max-num-seqs") + 1] == "7"
        # the environment other parts add (the collectors' engine plugin) survives a reload: it was lost before
        assert replica.staged_spec.env["APPLIANCE_ENGINE_STATS_DIR"] == str(tmp_path)
    with pytest.raises(ValueError):
        supervisor.stage(settings.engine.model_copy(update={"base_port": settings.engine.base_port + 1}))
    with pytest.raises(ValueError, match="nothing to rebuild"):
        Supervisor(build_specs(settings, tmp_path)).stage(settings.engine)


def test_a_dead_engine_leaves_routing_at_once_not_at_the_next_health_probe(tmp_path):
    port = free_port()
    replica = SupervisedReplica(spec(tmp_path, engine(port), port), backoff_initial=30)
    replica.HEALTH_INTERVAL_SECONDS = 60.0  # the next probe is a minute away

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        await asyncio.sleep(0.5)  # into the long sleep between probes
        os.killpg(replica.status.pid, signal.SIGKILL)
        await until(lambda: replica.status.state is not ReplicaState.READY, 10)
        assert replica.status.crashes == 1
        await replica.stop()

    run(scenario)


def chatty_spec(tmp_path: Path, port: int) -> ReplicaSpec:
    replica_spec = spec(tmp_path, engine(port, "--chatter", "2000"), port)
    replica_spec.log_max_bytes, replica_spec.log_backups, replica_spec.log_stdout = 20_000, 2, True
    return replica_spec


def test_engine_output_goes_to_a_rotated_log_and_prefixed_to_stdout(tmp_path, capsys):
    port = free_port()
    replica = SupervisedReplica(chatty_spec(tmp_path, port))

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        await replica.stop()

    run(scenario)
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["engine-0.log", "engine-0.log.1", "engine-0.log.2"]
    assert all(p.stat().st_size <= 20_000 for p in logs.iterdir())
    assert "fake engine line 001999 " in "".join(p.read_text() for p in logs.iterdir())
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[replica-0] === appliance: starting replica-0")
    chatter = [line for line in out if line.startswith("[replica-0] fake engine line ")]
    assert len(chatter) == 2000  # stderr's lines (every tenth) too, each once
    assert "[replica-0] fake engine line 000010 " in chatter[10]


def test_a_broken_log_destination_does_not_stop_the_replica(tmp_path, monkeypatch):
    class BrokenStdout:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    port = free_port()
    monkeypatch.setattr(sys, "stdout", BrokenStdout())
    replica = SupervisedReplica(chatty_spec(tmp_path, port))

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        assert replica.status.crashes == 0 and replica.status.spawn_failures == 0
        await replica.stop()

    run(scenario)
    assert "fake engine line 001999 " in (tmp_path / "logs" / "engine-0.log").read_text()


def test_unstage_undoes_a_staged_spec_whether_or_not_the_replica_started_on_it(tmp_path):
    """A reload whose roll stops: replicas not reached keep their own spec, the one that started on the new spec
    goes back to its previous one at its next start (a crash restart must not bring the bad settings back)."""
    port = free_port()
    original = spec(tmp_path, engine(port), port)
    replica = SupervisedReplica(original)

    async def scenario(session):
        replica.start(session)
        await until(lambda: replica.status.state is ReplicaState.READY)
        replica.stage(spec(tmp_path, engine(port, "--tag=reloaded"), port))
        replica.unstage()
        assert replica.staged_spec is None and replica.spec is original  # not started on it: simply dropped
        replica.stage(spec(tmp_path, engine(port, "--tag=reloaded"), port))
        await replica.restart()
        await until(lambda: replica.status.state is ReplicaState.READY)
        assert "--tag=reloaded" in replica.spec.command
        replica.unstage()
        assert replica.staged_spec is original  # started on it: the previous spec from the next start on
        await replica.stop()

    run(scenario)
