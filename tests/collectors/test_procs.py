"""Replica process trees: found from the launcher down, roles from vLLM's process titles, shared per scrape."""

from __future__ import annotations

import os

import pytest

from appliance.collectors.procs import API_SERVER, ENGINE_CORE, OTHER, WORKER, ProcessTable, classify, descendants
from tests.collectors.support import EngineTree, FakeClock, cpu_replica, gpu_replica


@pytest.mark.parametrize(("cmdline", "role"), [
    (["VLLM::EngineCore"], ENGINE_CORE),
    (["VLLM::EngineCore_DP1"], ENGINE_CORE),
    (["VLLM::Worker_TP1"], WORKER),
    (["VLLM::APIServer_0"], API_SERVER),
    (["custom::Worker"], WORKER),
    (["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/EngineCore"], API_SERVER),
    (["/usr/bin/python3", "-m", "appliance.engine.launch", "--", "python", "-m", "vllm.entrypoints.x"], OTHER),
    (["/usr/bin/python3", "-c", "from multiprocessing.resource_tracker import main"], OTHER),
    ([], OTHER),
])
def test_classify(cmdline: list[str], role: str) -> None:
    assert classify(cmdline) == role


def test_descendants_follow_the_tree(idle_tree: EngineTree) -> None:
    assert set(descendants(idle_tree.pid)) == {idle_tree.api_server.pid, idle_tree.engine_core.pid}


def test_snapshot_reads_the_tree_with_roles(idle_tree: EngineTree) -> None:
    table = ProcessTable(lambda: [cpu_replica("replica-0", idle_tree.pid, cores=(0,))])
    procs = table.snapshot()["replica-0"]
    roles = {p.pid: p.role for p in procs.procs}
    assert roles == {idle_tree.pid: OTHER, idle_tree.api_server.pid: API_SERVER,
                     idle_tree.engine_core.pid: ENGINE_CORE}
    assert procs.rss_bytes > 3 * 2**20
    assert procs.cpu_seconds > 0
    assert procs.cores == 1 and procs.device == "cpu"
    assert table.owners()[idle_tree.engine_core.pid] == "replica-0"


def test_snapshot_is_shared_until_invalidated() -> None:
    clock = FakeClock()
    calls = []

    def replicas() -> list:
        calls.append(1)
        return [cpu_replica("replica-0", os.getpid())]

    table = ProcessTable(replicas, ttl=0.5, clock=clock)
    first = table.snapshot()
    assert table.snapshot() is first and len(calls) == 1
    table.invalidate()
    table.snapshot()
    clock.advance(1.0)
    table.snapshot()
    assert len(calls) == 3


def test_replicas_without_a_process_or_a_live_one_are_left_out(idle_tree: EngineTree) -> None:
    dead = cpu_replica("replica-1", 2**22 + 12345)  # above pid_max's default: never a live pid
    table = ProcessTable(lambda: [cpu_replica("replica-0", None), dead, gpu_replica("replica-2", idle_tree.pid, (0,))])
    snapshot = table.snapshot()
    assert set(snapshot) == {"replica-2"}
    assert snapshot["replica-2"].device == "cuda"
    assert snapshot["replica-2"].cores == len(os.sched_getaffinity(0))


def test_a_departed_process_is_dropped_and_the_tree_walked_again(fresh_tree: EngineTree) -> None:
    clock = FakeClock()
    table = ProcessTable(lambda: [cpu_replica("replica-0", fresh_tree.pid)], tree_refresh_seconds=60, clock=clock)
    assert len(table.snapshot()["replica-0"].procs) == 3
    fresh_tree.engine_core.kill()
    fresh_tree.engine_core.wait(5)
    table.invalidate()
    assert {p.pid for p in table.snapshot()["replica-0"].procs} == {fresh_tree.pid, fresh_tree.api_server.pid}
