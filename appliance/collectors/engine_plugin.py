"""vLLM general plugin: allocator statistics from inside every engine process, for the gateway to export.

Fragmentation (a process that holds free memory it cannot hand out as one large block) is invisible from
outside: RSS and NVML see what the allocator holds, not how much of it is free. So each engine process (API
server, engine core, workers; vLLM loads general plugins in all of them) writes what its allocators say to
``$APPLIANCE_ENGINE_STATS_DIR/<pid>.json`` every few seconds, and the gateway's memory collector reads the files
of each replica's pids at scrape time:

- PyTorch's CUDA caching allocator, when this process has initialised CUDA: reserved, allocated and inactive
  split bytes, allocation retries (cudaMalloc failed, caches were flushed and the call retried: the symptom of
  fragmentation under pressure) and OOMs;
- glibc malloc (``mallinfo2``) always: bytes in arenas and mmapped chunks, in use, free in arenas, releasable.

Rules: nothing happens unless the environment variable is set (the appliance sets it for its engines); one
writer thread per process however many times ``register()`` is called (vLLM may load plugins several times, and
a forked child gets its own thread); every write is atomic (temp file + rename) so the reader never sees half a
file; and nothing here may raise into vLLM. Only the standard library is imported at load time (this module is
imported in every engine process); psutil and torch are used only if the engine already has them.

Entry point (pyproject.toml): ``[project.entry-points."vllm.general_plugins"]``
``appliance_allocator_stats = "appliance.collectors.engine_plugin:register"``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENGINE_STATS_DIR_ENV = "APPLIANCE_ENGINE_STATS_DIR"
ENGINE_STATS_INTERVAL_ENV = "APPLIANCE_ENGINE_STATS_INTERVAL_SECONDS"
DEFAULT_INTERVAL_SECONDS = 5.0
FORMAT_VERSION = 1

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"thread": None, "pid": None, "stop": None, "fork_hook": False}


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): like mallinfo, but size_t fields that do not wrap at 2 GiB."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def register() -> None:
    """vLLM's entry point: start this process's writer thread if the appliance asked for statistics."""
    try:
        directory = os.environ.get(ENGINE_STATS_DIR_ENV)
        if not directory:
            return
        _start(Path(directory), _interval())
    except Exception:  # a statistics plugin must never take an engine down
        log.debug("appliance allocator stats plugin failed to start", exc_info=True)


def _interval() -> float:
    try:
        return max(0.5, float(os.environ.get(ENGINE_STATS_INTERVAL_ENV, DEFAULT_INTERVAL_SECONDS)))
    except ValueError:
        return DEFAULT_INTERVAL_SECONDS


def _start(directory: Path, interval: float) -> None:
    with _lock:
        thread = _state["thread"]
        if thread is not None and thread.is_alive() and _state["pid"] == os.getpid():
            return
        stop = threading.Event()
        thread = threading.Thread(target=_run, args=(directory, interval, stop), name="appliance-alloc-stats",
                                  daemon=True)
        _state.update(thread=thread, pid=os.getpid(), stop=stop)
        if not _state["fork_hook"]:
            # A forked child inherits "plugins loaded" from vLLM but not the thread: give it its own.
            os.register_at_fork(after_in_child=_after_fork)
            atexit.register(_remove_own_file)
            _state["fork_hook"] = True
        thread.start()


def _after_fork() -> None:
    _state.update(thread=None, pid=None, stop=None)
    register()


def stop() -> None:
    """Stop this process's writer thread (tests; engines simply exit)."""
    with _lock:
        event, thread = _state["stop"], _state["thread"]
        _state.update(thread=None, pid=None, stop=None)
    if event is not None:
        event.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5)


def _run(directory: Path, interval: float, stop_event: threading.Event) -> None:
    while True:
        try:
            write_stats(directory)
        except Exception:  # a full disk or a removed directory: try again next time, quietly
            log.debug("writing allocator stats failed", exc_info=True)
        if stop_event.wait(interval):
            return


def write_stats(directory: Path) -> Path:
    """Write this process's allocator statistics to ``<directory>/<pid>.json`` atomically; return the path."""
    from appliance.files import atomic_write_text

    return atomic_write_text(directory / f"{os.getpid()}.json", json.dumps(collect_stats()), mode=0o644)


def collect_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {"version": FORMAT_VERSION, "pid": os.getpid(), "create_time": _create_time(),
                             "written_at": time.time()}
    malloc = malloc_stats()
    if malloc is not None:
        stats["malloc"] = malloc
    cuda = cuda_stats()
    if cuda is not None:
        stats["cuda"] = cuda
    return stats


def malloc_stats() -> dict[str, int] | None:
    """glibc's view of the heap; free_held_bytes is free memory inside arenas that malloc keeps, not returns."""
    info = _mallinfo2()
    if info is None:
        return None
    held = info.arena + info.hblkhd
    return {
        "held_bytes": held,  # arenas (sbrk/mmap'd heaps) + chunks mmapped individually
        "in_use_bytes": info.uordblks + info.hblkhd,
        "free_held_bytes": info.fordblks,
        "releasable_bytes": info.keepcost,  # free at the top of the main arena: malloc_trim could return it
        "mmap_bytes": info.hblkhd,
    }


def _mallinfo2() -> _Mallinfo2 | None:
    function = _state.get("mallinfo2")
    if function is None:
        try:
            function = ctypes.CDLL(None).mallinfo2
        except (OSError, AttributeError):  # not glibc, or glibc older than 2.33
            return None
        function.restype = _Mallinfo2
        function.argtypes = []
        _state["mallinfo2"] = function
    info: _Mallinfo2 = function()
    return info


def cuda_stats() -> dict[str, int] | None:
    """PyTorch's CUDA caching allocator, summed over the devices this process uses; None without CUDA."""
    torch = sys.modules.get("torch")  # never import torch here: only report what the engine already uses
    if torch is None or not torch.cuda.is_initialized():
        return None
    totals = {"reserved": 0, "allocated": 0, "inactive_split": 0, "retries": 0, "ooms": 0}
    for device in range(torch.cuda.device_count()):
        # Per device, never the "current" one: this thread's current device is 0, not the worker's.
        stats = torch.cuda.memory_stats(device)
        totals["reserved"] += int(stats.get("reserved_bytes.all.current", 0))
        totals["allocated"] += int(stats.get("allocated_bytes.all.current", 0))
        totals["inactive_split"] += int(stats.get("inactive_split_bytes.all.current", 0))
        totals["retries"] += int(stats.get("num_alloc_retries", 0))
        totals["ooms"] += int(stats.get("num_ooms", 0))
    return {
        "held_bytes": totals["reserved"],
        "in_use_bytes": totals["allocated"],
        "free_held_bytes": totals["reserved"] - totals["allocated"],
        "inactive_split_bytes": totals["inactive_split"],
        "alloc_retries": totals["retries"],
        "ooms": totals["ooms"],
    }


def _create_time() -> float | None:
    """The process's start time as psutil computes it, so the reader can tell a reused pid from this one."""
    try:
        import psutil  # vLLM depends on it, so it is installed wherever engines run (imported already, mostly)
    except ImportError:
        return None
    try:
        return float(psutil.Process().create_time())
    except Exception:
        return None


def _remove_own_file() -> None:
    """At a clean exit, stop writing and remove this process's file (the reader cleans up after hard kills)."""
    directory = os.environ.get(ENGINE_STATS_DIR_ENV)
    if not directory or _state["pid"] != os.getpid():
        return
    stop()  # first, or the thread could write the file again after it is removed
    with contextlib.suppress(OSError):
        (Path(directory) / f"{os.getpid()}.json").unlink()
