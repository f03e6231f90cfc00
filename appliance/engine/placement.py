"""Which hardware each replica gets: disjoint GPU sets on GPU hosts, disjoint core slices on CPU hosts.

Replicas never share a device: two engines on one GPU fight over memory, two on one core fight over the
scheduler (the seed's "CPU threads starving the accelerator").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The host does not have the devices the configuration asks for."""


@dataclass(frozen=True)
class Placement:
    """The devices of one replica, and the environment that pins the engine to them."""

    device: str  # "cpu" or "cuda"
    gpus: tuple[int, ...] = ()
    cores: tuple[int, ...] = ()

    def env(self) -> dict[str, str]:
        if self.device == "cuda":
            # PCI bus order makes CUDA's device numbers the same as NVML's, so `gpu` labels name the right card.
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.gpus)}
        return {"VLLM_CPU_OMP_THREADS_BIND": _core_list(self.cores)}

    def describe(self) -> str:
        if self.device == "cuda":
            return "gpu " + ",".join(str(g) for g in self.gpus)
        return "cpu " + _core_list(self.cores)


def detect_device(requested: str) -> str:
    """Resolve ``auto`` to ``cuda`` when NVML sees at least one GPU, else ``cpu``."""
    if requested != "auto":
        return requested
    return "cuda" if count_gpus() > 0 else "cpu"


def count_gpus() -> int:
    """GPUs visible through NVML; 0 when the driver or the library is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # absent library, absent driver: both mean "no GPU here"
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def plan_placements(
    replicas: int, device: str, *, tensor_parallel_size: int = 1, gpu_count: int | None = None,
    cores: list[int] | None = None,
) -> list[Placement]:
    """Split the host's devices into ``replicas`` disjoint slices."""
    if device == "cuda":
        return _gpu_placements(replicas, tensor_parallel_size, count_gpus() if gpu_count is None else gpu_count)
    return _cpu_placements(replicas, sorted(os.sched_getaffinity(0)) if cores is None else cores)


def _gpu_placements(replicas: int, per_replica: int, gpu_count: int) -> list[Placement]:
    needed = replicas * per_replica
    if needed > gpu_count:
        raise PlacementError(
            f"{replicas} replicas x tensor_parallel_size {per_replica} need {needed} GPUs; {gpu_count} visible"
        )
    return [
        Placement("cuda", gpus=tuple(range(i * per_replica, (i + 1) * per_replica))) for i in range(replicas)
    ]


def _cpu_placements(replicas: int, cores: list[int]) -> list[Placement]:
    if replicas > len(cores):
        # Oversubscribed: still start, but every replica shares all cores. Said loudly, never silently.
        log.warning("%d replicas on %d cores: replicas share cores and will slow each other", replicas, len(cores))
        return [Placement("cpu", cores=tuple(cores)) for _ in range(replicas)]
    per_replica = len(cores) // replicas
    return [Placement("cpu", cores=tuple(cores[i * per_replica:(i + 1) * per_replica])) for i in range(replicas)]


def _core_list(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)
