"""Memory: the engine plugin's statistics files (written in-process here), their reader, RSS and host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry

from appliance.collectors import engine_plugin
from appliance.collectors.base import CollectorHealth, HealthCollector, ScrapeStart
from appliance.collectors.memory import AllocatorStatsReader, MemoryCollector
from appliance.collectors.procs import ProcessTable
from tests.collectors.support import EngineTree, FakeClock, cpu_replica, scrape, value


@pytest.fixture
def stats_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    directory = tmp_path / "engine-stats"
    monkeypatch.setenv(engine_plugin.ENGINE_STATS_DIR_ENV, str(directory))
    yield directory
    engine_plugin.stop()


def test_write_stats_writes_malloc_statistics_atomically(tmp_path: Path) -> None:
    path = engine_plugin.write_stats(tmp_path / "stats")
    stats = json.loads(path.read_text())
    assert path.name == f"{os.getpid()}.json"
    assert stats["pid"] == os.getpid()
    assert stats["create_time"] == pytest.approx(psutil.Process().create_time())
    assert time.time() - stats["written_at"] < 5
    malloc = stats["malloc"]
    assert malloc["held_bytes"] >= malloc["in_use_bytes"] > 0
    assert 0 <= malloc["free_held_bytes"] <= malloc["held_bytes"]
    assert "cuda" not in stats  # torch with CUDA is not initialised in this process
    assert [p.name for p in (tmp_path / "stats").iterdir()] == [path.name]  # no temp file left behind


def test_cuda_statistics_are_summed_over_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    per_device = {0: {"reserved_bytes.all.current": 1000, "allocated_bytes.all.current": 600,
                      "inactive_split_bytes.all.current": 50, "num_alloc_retries": 2, "num_ooms": 0},
                  1: {"reserved_bytes.all.current": 500, "allocated_bytes.all.current": 500,
                      "inactive_split_bytes.all.current": 0, "num_alloc_retries": 1, "num_ooms": 1}}
    cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2,
                                 memory_stats=lambda device: per_device[device])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert engine_plugin.cuda_stats() == {"held_bytes": 1500, "in_use_bytes": 1100, "free_held_bytes": 400,
                                          "inactive_split_bytes": 50, "alloc_retries": 3, "ooms": 1}
    assert engine_plugin.collect_stats()["cuda"]["held_bytes"] == 1500


def test_cuda_statistics_absent_until_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = types.SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert engine_plugin.cuda_stats() is None


def test_register_does_nothing_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_plugin.ENGINE_STATS_DIR_ENV, raising=False)
    engine_plugin.register()
    assert not _writer_threads()


def test_register_is_idempotent_and_writes_periodically(stats_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_plugin.ENGINE_STATS_INTERVAL_ENV, "0.5")
    for _ in range(3):
        engine_plugin.register()
    assert len(_writer_threads()) == 1
    path = stats_dir / f"{os.getpid()}.json"
    first = _wait_for(path)
    deadline = time.monotonic() + 5
    while json.loads(path.read_text())["written_at"] == first["written_at"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(path.read_text())["written_at"] > first["written_at"]
    engine_plugin.stop()
    assert not _writer_threads()


def test_register_never_raises(stats_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_plugin, "_start", _explode)
    engine_plugin.register()


def test_a_failing_write_does_not_kill_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(engine_plugin.ENGINE_STATS_DIR_ENV, str(blocker / "stats"))
    monkeypatch.setenv(engine_plugin.ENGINE_STATS_INTERVAL_ENV, "0.5")
    engine_plugin.register()
    time.sleep(0.2)
    assert len(_writer_threads()) == 1
    engine_plugin.stop()


def test_a_forked_child_gets_its_own_writer(stats_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_plugin.ENGINE_STATS_INTERVAL_ENV, "0.5")
    engine_plugin.register()
    _wait_for(stats_dir / f"{os.getpid()}.json")
    pid = os.fork()
    if pid == 0:  # the child: vLLM would not call register() again here; the fork hook must
        deadline = time.monotonic() + 5
        while not (stats_dir / f"{os.getpid()}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0 if (stats_dir / f"{os.getpid()}.json").exists() else 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("forked child did not write its statistics")


def _explode(*_args: object) -> None:
    raise RuntimeError("boom")


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "appliance-alloc-stats" and t.is_alive()]


def _wait_for(path: Path, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


# -- the reader and the collector ------------------------------------------------------------------------------


def write_file(directory: Path, pid: int, *, create_time: float | None = None, written_at: float | None = None,
               **kinds: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    created = create_time if create_time is not None else psutil.Process(pid).create_time()
    stats = {"version": 1, "pid": pid, "create_time": created, "written_at": written_at or time.time(), **kinds}
    (directory / f"{pid}.json").write_text(json.dumps(stats))


def build(tmp_path: Path, replicas: list) -> tuple[CollectorRegistry, Path]:
    directory = tmp_path / "engine-stats"
    registry = CollectorRegistry()
    health = CollectorHealth()
    table = ProcessTable(lambda: replicas)
    registry.register(ScrapeStart(table))
    registry.register(MemoryCollector(table, AllocatorStatsReader(directory, max_age_seconds=30), health=health))
    registry.register(HealthCollector(health))
    return registry, directory


def test_allocator_statistics_per_replica_and_kind(tmp_path: Path, idle_tree: EngineTree) -> None:
    registry, directory = build(tmp_path, [cpu_replica("replica-0", idle_tree.pid)])
    write_file(directory, idle_tree.api_server.pid,
               malloc={"held_bytes": 1000, "in_use_bytes": 900, "free_held_bytes": 100})
    write_file(directory, idle_tree.engine_core.pid,
               malloc={"held_bytes": 3000, "in_use_bytes": 2000, "free_held_bytes": 1000},
               cuda={"held_bytes": 8000, "in_use_bytes": 6000, "free_held_bytes": 2000, "inactive_split_bytes": 500,
                     "alloc_retries": 4, "ooms": 1})
    families = scrape(registry)
    assert value(families, "appliance_engine_allocator_reserved_bytes", replica="replica-0", kind="malloc") == 4000
    assert value(families, "appliance_engine_allocator_allocated_bytes", replica="replica-0", kind="malloc") == 2900
    assert value(families, "appliance_engine_allocator_free_held_bytes", replica="replica-0", kind="malloc") == 1100
    assert value(families, "appliance_engine_memory_fragmentation_ratio", replica="replica-0",
                 kind="malloc") == pytest.approx(1100 / 4000)
    assert value(families, "appliance_engine_memory_fragmentation_ratio", replica="replica-0",
                 kind="cuda") == pytest.approx(0.25)
    assert value(families, "appliance_engine_allocator_inactive_split_bytes", replica="replica-0") == 500
    assert value(families, "appliance_engine_allocation_retries_total", replica="replica-0") == 4
    assert value(families, "appliance_engine_oom_total", replica="replica-0") == 1
    assert value(families, "appliance_collector_source", collector="memory", source="allocator_files") == 1


def test_stale_foreign_and_reused_pid_files_are_ignored(tmp_path: Path, idle_tree: EngineTree) -> None:
    registry, directory = build(tmp_path, [cpu_replica("replica-0", idle_tree.pid)])
    stats = {"malloc": {"held_bytes": 10, "in_use_bytes": 5, "free_held_bytes": 5}}
    write_file(directory, idle_tree.api_server.pid, written_at=time.time() - 3600, **stats)  # hung writer
    write_file(directory, idle_tree.engine_core.pid, create_time=1.0, **stats)  # an earlier owner of the pid
    write_file(directory, idle_tree.pid, **stats)
    (directory / f"{idle_tree.pid}.json").write_text("{not json")  # torn (never, with rename) or foreign
    write_file(directory, os.getpid(), **stats)  # not a process of any replica
    families = scrape(registry)
    assert families["appliance_engine_allocator_reserved_bytes"].samples == []
    assert "allocator_files" not in {s.labels["source"] for s in families["appliance_collector_source"].samples}


def test_files_of_dead_processes_are_cleaned_up(tmp_path: Path) -> None:
    directory = tmp_path / "engine-stats"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_file(directory, os.getpid())
    write_file(directory, gone.pid, create_time=0.0)
    (directory / f".{gone.pid}.json.tmp").write_text("")
    (directory / "unrelated.txt").write_text("")
    clock = FakeClock()
    reader = AllocatorStatsReader(directory, cleanup_seconds=60, clock=clock)
    reader.read({})
    assert sorted(p.name for p in directory.iterdir()) == sorted([f"{os.getpid()}.json", "unrelated.txt"])


def test_rss_and_host_memory(tmp_path: Path, idle_tree: EngineTree) -> None:
    registry, _ = build(tmp_path, [cpu_replica("replica-0", idle_tree.pid)])
    families = scrape(registry)
    expected = sum(psutil.Process(p).memory_info().rss for p in
                   (idle_tree.pid, idle_tree.api_server.pid, idle_tree.engine_core.pid))
    assert value(families, "appliance_engine_resident_memory_bytes", replica="replica-0") == pytest.approx(
        expected, rel=0.2)
    assert value(families, "appliance_host_memory_total_bytes") == psutil.virtual_memory().total
    assert 0 < value(families, "appliance_host_memory_available_bytes") <= psutil.virtual_memory().total
    assert value(families, "appliance_host_swap_used_bytes") >= 0


def test_without_a_stats_directory_or_replicas(tmp_path: Path) -> None:
    registry, _ = build(tmp_path, [])
    families = scrape(registry)
    assert families["appliance_engine_resident_memory_bytes"].samples == []
    assert value(families, "appliance_collector_source", collector="memory", source="host_memory") == 1


def test_the_plugin_imports_only_the_standard_library() -> None:
    """vLLM imports the plugin in every engine process: the package must not drag the gateway's imports in."""
    code = ("import sys, appliance.collectors.engine_plugin as p; p.register()\n"
            "heavy = {'prometheus_client', 'psutil', 'pydantic', 'numpy', 'appliance.engine', 'appliance.gateway'}\n"
            "print(sorted(heavy & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                            env={k: v for k, v in os.environ.items() if k != engine_plugin.ENGINE_STATS_DIR_ENV})
    assert result.stdout.strip() == "[]"
