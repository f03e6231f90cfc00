"""Test doubles for the collectors: replicas over real processes, a fake pynvml, a fake clock, page parsing."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.doubles import FakeClock, FakeReplica, cpu_replica, gpu_replica  # noqa: F401 - the collectors' doubles


def scrape(registry: CollectorRegistry) -> dict[str, Metric]:
    """The page as Prometheus would parse it; fails on a malformed page or a family exported twice."""
    page = generate_latest(registry).decode()
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(page):
        assert family.name not in families, f"{family.name} exported twice"
        families[family.name] = family
    return families


def value(families: dict[str, Metric], metric: str, /, **labels: str) -> float | None:
    """The value of the first sample of ``metric`` (a counter may be named with its _total) with these labels."""
    family = families.get(metric) or families.get(metric.removesuffix("_total"))
    if family is None:
        return None
    for sample in family.samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def label_sets(families: dict[str, Metric], metric: str) -> list[dict[str, str]]:
    family = families.get(metric) or families.get(metric.removesuffix("_total"))
    return [dict(s.labels) for s in family.samples] if family is not None else []


@dataclass
class EngineTree:
    """A launcher -> "api server" -> "engine core" process tree shaped like a replica's."""

    launcher: subprocess.Popen
    api_server: psutil.Process
    engine_core: psutil.Process

    @property
    def pid(self) -> int:
        return self.launcher.pid


def spawn_engine_tree(busy: bool = False, timeout: float = 10.0) -> EngineTree:
    """Start a tree: launcher (sleeps) -> api server (argv names vllm.entrypoints) -> engine core (titled)."""
    api_code = (
        "import subprocess, sys, time\n"
        "import ctypes; ctypes.CDLL('libc.so.6').prctl(1, 9)\n"
        "code = ('import ctypes, setproctitle, sys, time\\n'\n"
        "        'ctypes.CDLL(\"libc.so.6\").prctl(1, 9)\\n'\n"
        "        'setproctitle.setproctitle(\"VLLM::\" + \"Engine\" + \"Core\")\\n'\n"
        "        'end = time.time() + 300\\n'\n"
        "        'while time.time() < end:\\n'\n"
        "        '    sum(range(10000)) if sys.argv[1] == \"busy\" else time.sleep(0.05)\\n')\n"
        "core = subprocess.Popen([sys.executable, '-c', code, sys.argv[2]])\n"
        "core.wait()\n"
        "time.sleep(300)\n"
    )
    launcher_code = (
        "import ctypes, subprocess, sys\n"
        "ctypes.CDLL('libc.so.6').prctl(1, 9)  # die with the test run, whatever happens to it\n"
        "api = subprocess.Popen([sys.executable, '-c', sys.argv[1], 'vllm.entrypoints.openai.api_server',"
        " sys.argv[2]])\n"
        "api.wait()\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, api_code, "busy" if busy else "idle"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = psutil.Process(launcher.pid).children(recursive=True)
        cores = [p for p in tree if "EngineCore" in " ".join(_cmdline(p))]
        if len(tree) >= 2 and cores:
            api = next(p for p in tree if p.ppid() == launcher.pid)
            return EngineTree(launcher, api, cores[0])
        time.sleep(0.05)
    stop_tree(launcher)
    raise RuntimeError("process tree did not come up")


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def stop_tree(launcher: subprocess.Popen) -> None:
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for process in [*children, launcher]:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            process.kill()
    launcher.wait(timeout=5)


def engine_tree_fixture(busy: bool) -> Iterator[EngineTree]:
    tree = spawn_engine_tree(busy=busy)
    try:
        yield tree
    finally:
        stop_tree(tree.launcher)


# -- a fake pynvml ---------------------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class _MetricsRequest:
    """Stands in for ctypes ``c_nvmlGpmMetricsGet_t`` (whose sample pointers reject fake samples)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [types.SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(210)]


def fake_pynvml(*, gpus: int = 2, processes: dict[int, list[tuple[int, int]]] | None = None,
                gpm_gpus: tuple[int, ...] = (0,), no_power: tuple[int, ...] = (1,),
                name: str = "NVIDIA H100 80GB HBM3") -> types.ModuleType:
    """A pynvml stand-in: GPU i is (20 + 10 i)% busy; GPM on ``gpm_gpus``; power unsupported on ``no_power``.

    GPM samples carry a counter; the fake metrics are 10 x (sample2 - sample1)% so tests see which pair was used.
    """
    module = types.ModuleType("pynvml")
    module.NVML_ERROR_NOT_SUPPORTED = 3
    module.NVML_TEMPERATURE_GPU = 0
    module.NVML_CLOCK_MEM = 2
    module.NVML_GPM_METRICS_GET_VERSION = 1
    module.NVMLError = FakeNVMLError
    module.c_nvmlGpmMetricsGet_t = _MetricsRequest
    module.calls = {"init": 0, "samples": 0}
    processes = processes or {}
    counter = {"n": 0}

    def init() -> None:
        module.calls["init"] += 1

    def power(handle: int) -> int:
        if handle in no_power:
            raise FakeNVMLError(3)
        return 350_000 + handle

    def sample_get(handle: int, sample: types.SimpleNamespace) -> types.SimpleNamespace:
        counter["n"] += 1
        module.calls["samples"] += 1
        sample.n = counter["n"]
        return sample

    def metrics_get(request: _MetricsRequest) -> _MetricsRequest:
        delta = request.sample2.n - request.sample1.n
        for slot in range(request.numMetrics):
            request.metrics[slot].value = float(min(100, 10 * delta + request.metrics[slot].metricId))
            request.metrics[slot].nvmlReturn = 0
        return request

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: gpus
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = lambda h: name
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=20 + 10 * h, memory=40 + h)
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30,
                                                                     free=0)
    module.nvmlDeviceGetTemperature = lambda h, sensor: 60 + h
    module.nvmlDeviceGetPowerUsage = power
    module.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes.get(h, [])]
    module.nvmlDeviceGetMemoryBusWidth = lambda h: 5120
    module.nvmlDeviceGetMaxClockInfo = lambda h, clock: 2619
    module.nvmlGpmQueryDeviceSupport = lambda h: types.SimpleNamespace(isSupportedDevice=int(h in gpm_gpus))
    module.nvmlGpmSampleAlloc = lambda: types.SimpleNamespace(n=0)
    module.nvmlGpmSampleFree = lambda sample: None
    module.nvmlGpmSampleGet = sample_get
    module.nvmlGpmMetricsGet = metrics_get
    return module


def write_model(directory: Path, *, int8: bool = False, tied: bool = False) -> Path:
    """A tiny Llama-shaped checkpoint: 2 layers, hidden 64, 4 heads (2 KV heads) of dim 16, vocab 100."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weight = np.int8 if int8 else np.float32
    tensors = {"model.embed_tokens.weight": np.zeros((100, 64), np.float32),
               "model.norm.weight": np.zeros((64,), np.float32)}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.self_attn.q_proj.weight"] = np.zeros((64, 64), weight)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = np.zeros((32, 64), weight)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = np.zeros((32, 64), weight)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = np.zeros((64, 64), weight)
        tensors[f"{prefix}.mlp.down_proj.weight"] = np.zeros((64, 128), weight)
        tensors[f"{prefix}.mlp.down_proj.weight_scale"] = np.zeros((64, 1), np.float32)
        tensors[f"{prefix}.input_layernorm.weight"] = np.zeros((64,), np.float32)
    if not tied:
        tensors["lm_head.weight"] = np.zeros((100, 64), np.float32)
    half = len(tensors) // 2
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:half]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(directory / "model-00002-of-00002.safetensors"))
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
