"""What the resource collectors cost the gateway: /metrics scrape time, and CPU seconds per minute at a 15 s and a
1 s scrape interval, with the fake replicas idle and busy. Not a test: numbers are printed, never asserted.

Each fake replica is a real process tree shaped like an engine's (launcher -> "API server" -> "engine core"
titled ``VLLM::EngineCore``), and both of its Python processes load the appliance's engine plugin, so the memory
collector reads real allocator files. Busy replicas spin their engine core. Engine readings are fakes that
advance like a serving engine's.

Scrapes run back to back, so two costs are measured separately and then combined per interval:
``walk`` (every scrape walks the process trees again: what a scrape every 15 s does, since trees are reused for
10 s) and ``cached`` (trees reused: nine scrapes in ten at a 1 s interval).

    .venv/bin/python bench/collectors_cost.py [--replicas 2] [--scrapes 200] [--fake-gpus 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, generate_latest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.collectors import engine_stats_env, register_collectors  # noqa: E402
from appliance.collectors.engine_plugin import write_stats  # noqa: E402
from appliance.collectors.settings import CollectorSettings  # noqa: E402
from appliance.engine.contract import ReplicaState, ReplicaStatus  # noqa: E402
from appliance.engine.load import EngineLoad  # noqa: E402
from appliance.engine.placement import Placement  # noqa: E402

PLUGIN = ("import ctypes; ctypes.CDLL('libc.so.6').prctl(1, 9)  # die with the benchmark\n"
          "import appliance.collectors.engine_plugin as plugin; plugin.register()\n")
CORE = PLUGIN + (
    "import setproctitle, sys, time\n"
    "setproctitle.setproctitle('VLLM::' + 'Engine' + 'Core')\n"
    "ballast = [bytearray(4096) for _ in range(20000)]  # some heap for mallinfo to walk\n"
    "end = time.time() + 900\n"
    "while time.time() < end:\n"
    "    sum(range(20000)) if sys.argv[1] == 'busy' else time.sleep(0.05)\n"
)
API = PLUGIN + (
    "import subprocess, sys, time\n"
    "core = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
    "core.wait()\n"
)
LAUNCHER = (
    "import ctypes, subprocess, sys\n"
    "ctypes.CDLL('libc.so.6').prctl(1, 9)\n"
    "api = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]])\n"
    "api.wait()\n"
)


@dataclass
class BenchReplica:
    """What the collectors read of a replica (``appliance.engine.contract.Replica``), over real launcher trees."""

    name: str
    status: ReplicaStatus
    placement: Placement
    kv_cache_space_bytes: int | None = 2**30
    url: str = "http://127.0.0.1:1"
    routable: bool = True
    restartable: bool = False
    drainable: bool = False


def spawn(busy: bool, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, API, CORE, "busy" if busy else "idle"],
                            env={**os.environ, **env, "PYTHONPATH": str(REPO)}, cwd=REPO)


def stop(launcher: subprocess.Popen) -> None:
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for process in [*children, launcher]:
        with suppress(psutil.Error, ProcessLookupError):
            process.kill()
    launcher.wait(timeout=10)


def write_model(directory: Path) -> Path:
    """A small Llama-shaped checkpoint, so the roofline collector has real safetensors headers to read."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.layers.{i}.mlp.{p}.weight": np.zeros((128, 128), np.float32) for i in range(8)
               for p in ("up_proj", "down_proj", "gate_proj")}
    tensors["lm_head.weight"] = np.zeros((1000, 128), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 128,
                                                       "num_attention_heads": 4, "num_key_value_heads": 4}))
    return directory


def install_fake_nvml(gpus: int, owner_pids: list[int]) -> None:
    """A pynvml stand-in for the GPU code paths' Python cost (real NVML calls add the driver's own time)."""
    import types

    sys.path.insert(0, str(REPO))
    from tests.collectors.support import fake_pynvml

    module = fake_pynvml(gpus=gpus, gpm_gpus=tuple(range(gpus)), no_power=(),
                         processes={g: [(owner_pids[g % len(owner_pids)], 2**30)] for g in range(gpus)})
    assert isinstance(module, types.ModuleType)
    sys.modules["pynvml"] = module


def measure(registry: CollectorRegistry, scrapes: int, advance) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(scrapes):
        advance()
        cpu, wall = time.process_time(), time.perf_counter()
        generate_latest(registry)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


def build(replicas: list[BenchReplica], loads: dict[str, EngineLoad], settings: CollectorSettings, model: Path,
          state: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    register_collectors(registry, replicas=lambda: replicas, router_load=lambda: loads, settings=settings,
                        model_dir=model, state_dir=state)
    return registry


def run_case(busy: bool, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    base = CollectorSettings(probe_bandwidth=False, peak_flops=1e11, peak_memory_bandwidth_bytes_per_second=2e10,
                             engine_stats_interval_seconds=1.0, rate_min_window_seconds=0.001)
    state = tmp / "state"
    env = engine_stats_env(base, state)
    cores = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack:
        launchers = []
        for _i in range(args.replicas):
            launcher = spawn(busy, env)
            stack.callback(stop, launcher)
            launchers.append(launcher)
        replicas = [BenchReplica(f"replica-{i}", ReplicaStatus(ReplicaState.READY, pid=p.pid, starts=1),
                                 Placement("cpu", cores=(cores[i % len(cores)],)))
                    for i, p in enumerate(launchers)]
        _wait_for_trees(launchers, Path(env["APPLIANCE_ENGINE_STATS_DIR"]))
        if args.fake_gpus:
            install_fake_nvml(args.fake_gpus, [p.pid for p in launchers])
        loads: dict[str, EngineLoad] = {}
        counter = {"tokens": 0.0}

        def advance() -> None:
            counter["tokens"] += 100
            for replica in replicas:
                loads[replica.name] = EngineLoad(0.3, 2, 8, counter["tokens"], counter["tokens"] / 2,
                                                 read_at=time.monotonic())

        results = {}
        for mode, refresh in (("walk", 0.0), ("cached", 3600.0)):
            settings = base.model_copy(update={"process_tree_refresh_seconds": refresh})
            registry = build(replicas, loads, settings, args.model, state)
            measure(registry, 5, advance)  # warm up: first reads, model facts, GPM pairs
            walls, cpus = measure(registry, args.scrapes, advance)
            results[f"{mode}_wall_mean"] = statistics.fmean(walls)
            results[f"{mode}_wall_p99"] = p99(walls)
            results[f"{mode}_cpu_mean"] = statistics.fmean(cpus)
            results[f"{mode}_page_bytes"] = len(generate_latest(registry))
        return results


def _wait_for_trees(launchers: list[subprocess.Popen], stats: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trees = [psutil.Process(p.pid).children(recursive=True) for p in launchers]
        if all(len(t) >= 2 for t in trees) and len(list(stats.glob("*.json"))) >= 2 * len(launchers):
            return
        time.sleep(0.1)
    raise RuntimeError("fake replicas did not start")


def plugin_cost(tmp: Path, writes: int = 200) -> float:
    cpu = time.process_time()
    for _ in range(writes):
        write_stats(tmp / "plugin")
    return (time.process_time() - cpu) / writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--fake-gpus", type=int, default=0, help="also run the NVML/GPM code paths on a fake")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        args.model = write_model(tmp / "model")
        print(f"{args.replicas} fake replicas (3 processes each), {args.scrapes} scrapes per case, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, fake GPUs: {args.fake_gpus}")
        started = time.perf_counter()
        from appliance.collectors.probes import measure_host_peaks

        peaks = measure_host_peaks(CollectorSettings().probe_buffer_bytes)
        print(f"probe at registration: {time.perf_counter() - started:.2f} s "
              f"(one core {peaks.single_core_bandwidth / 1e9:.1f} GB/s, all {peaks.all_cores_bandwidth / 1e9:.1f} "
              f"GB/s, {peaks.flops / 1e9:.1f} GFLOP/s fp32)")
        print()
        header = (f"{'replicas':9} {'trees':7} {'mean ms':>8} {'p99 ms':>8} {'cpu ms':>7} {'page KB':>8}")
        print(header)
        summary = []
        for busy in (False, True):
            results = run_case(busy, args, tmp)
            label = "busy" if busy else "idle"
            for mode in ("walk", "cached"):
                print(f"{label:9} {mode:7} {results[f'{mode}_wall_mean'] * 1e3:8.2f} "
                      f"{results[f'{mode}_wall_p99'] * 1e3:8.2f} {results[f'{mode}_cpu_mean'] * 1e3:7.2f} "
                      f"{results[f'{mode}_page_bytes'] / 1024:8.1f}")
            summary.append((label, results))
        print()
        print(f"{'replicas':9} {'interval':>8} {'cpu s/min':>10} {'% of a core':>12}")
        for label, results in summary:
            for interval in (15.0, 1.0):
                # 15 s: every scrape re-walks the trees (reused 10 s); 1 s: one scrape in ten does.
                per_scrape = results["walk_cpu_mean"] if interval >= 10 else (
                    0.1 * results["walk_cpu_mean"] + 0.9 * results["cached_cpu_mean"])
                per_minute = per_scrape * 60 / interval
                print(f"{label:9} {interval:7.0f}s {per_minute:10.4f} {100 * per_minute / 60:11.3f}%")
        write = plugin_cost(tmp)
        print()
        print(f"engine plugin: {write * 1e3:.3f} ms CPU per write, every 5 s = "
              f"{write * 12:.4f} CPU s/min per engine process ({100 * write / 5:.4f}% of a core)")


if __name__ == "__main__":
    main()
