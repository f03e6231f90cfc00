"""The supervisor: one spec per replica on its own port and device slice, all started and all stopped."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import psutil

from appliance.composition.fleet import build_specs, build_supervisor
from appliance.engine.contract import ReplicaState
from appliance.engine.placement import Placement
from appliance.engine.replica import ReplicaSpec
from appliance.engine.supervisor import Supervisor
from appliance.settings import Settings
from tests.engine.support import FAKE_ENGINE, free_port


def test_specs_get_consecutive_ports_disjoint_cores_and_their_own_logs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint: settings read its max_model_len
    settings = Settings(model=tmp_path, replicas=2, engine_base_port=9100, device="cpu", state_dir=tmp_path)
    specs = build_specs(settings, tmp_path)
    assert [s.port for s in specs] == [9100, 9101]
    assert [s.name for s in specs] == ["replica-0", "replica-1"]
    assert not set(specs[0].placement.cores) & set(specs[1].placement.cores)
    assert specs[0].log_path != specs[1].log_path
    assert all("--port" in s.command and str(s.port) in s.command for s in specs)


def test_specs_carry_the_engine_log_settings(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint: settings read its max_model_len
    settings = Settings(model=tmp_path, device="cpu", state_dir=tmp_path, engine_log_max_bytes=4096,
                        engine_log_backups=1, engine_log_stdout=True)
    (spec,) = build_specs(settings, tmp_path)
    assert (spec.log_max_bytes, spec.log_backups, spec.log_stdout) == (4096, 1, True)
    assert spec.log_path == tmp_path / "logs" / "engine-0.log"


def test_start_and_stop_every_replica(tmp_path: Path) -> None:
    def fake(index: int) -> ReplicaSpec:
        port = free_port()
        return ReplicaSpec(index=index, port=port, command=[sys.executable, FAKE_ENGINE, str(port)], env={},
                           placement=Placement("cpu", cores=(0,)), log_path=tmp_path / f"engine-{index}.log",
                           start_timeout_seconds=30, stop_timeout_seconds=1)

    async def scenario() -> list[int]:
        supervisor = Supervisor([fake(0), fake(1)])
        await supervisor.start()
        deadline = time.monotonic() + 30
        while len(supervisor.ready()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        pids = [r.status.pid for r in supervisor.replicas]
        await supervisor.stop()
        assert all(r.status.state is ReplicaState.STOPPED for r in supervisor.replicas)
        return pids

    for pid in asyncio.run(scenario()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_missing_model_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="no model configured"):
        build_supervisor(Settings())
