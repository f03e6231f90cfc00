"""Each replica's process tree (launcher -> vLLM API server -> engine core -> workers), read once per scrape.

Several collectors need the same readings (CPU seconds, RSS, the pids that own GPU memory or allocator files),
so one ``ProcessTable`` reads them and hands out a snapshot that is reused for ``ttl`` seconds: one scrape reads
/proc once, however many collectors ask.

Cost is what matters here. Walking a tree with psutil's ``children(recursive=True)`` reads /proc/*/stat of every
process on the host; instead the kernel's per-task ``children`` files are followed from the launcher down (a few
reads per replica), and the tree (pids and their roles) is reused for ``tree_refresh_seconds``, since an engine's
processes only change when it starts. Per process a scrape reads /proc/<pid>/stat and statm once (``oneshot``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from appliance.collectors.base import Clock

if TYPE_CHECKING:
    from appliance.engine.contract import Replica

API_SERVER = "api_server"
ENGINE_CORE = "engine_core"
WORKER = "worker"
OTHER = "other"  # the launcher, multiprocessing's resource tracker and other helpers
ROLES = (API_SERVER, ENGINE_CORE, WORKER, OTHER)


def classify(cmdline: Sequence[str]) -> str:
    """The role of an engine process from its command line.

    vLLM titles its processes ``<prefix>::EngineCore``, ``<prefix>::Worker_TP0``, ``<prefix>::APIServer_0`` with
    setproctitle, which replaces what /proc/<pid>/cmdline shows; a single API server keeps its real command line
    (``python -m vllm.entrypoints.openai.api_server ...``). Only the title is matched, never arguments such as a
    model path, which could contain any of these words.
    """
    if not cmdline:
        return OTHER
    title = cmdline[0].split()[0] if cmdline[0].split() else ""
    if "::" in title:
        name = title.split("::", 1)[1]
        for prefix, role in (("EngineCore", ENGINE_CORE), ("Worker", WORKER), ("APIServer", API_SERVER)):
            if name.startswith(prefix):
                return role
        return OTHER
    return API_SERVER if any(arg.startswith("vllm.entrypoints") for arg in cmdline[1:4]) else OTHER


@dataclass(frozen=True)
class ProcSample:
    """One process of a replica at one scrape."""

    pid: int
    role: str
    create_time: float
    cpu_seconds: float  # user + system of the process itself
    reaped_cpu_seconds: float  # user + system of its children that exited and were waited for
    rss_bytes: int


@dataclass
class ReplicaProcs:
    """A replica's live processes at one scrape."""

    replica: str
    root_pid: int
    cores: int  # CPU cores the replica may use: its placement's, else the host's
    device: str  # "cpu" or "cuda"
    procs: list[ProcSample] = field(default_factory=list)

    @property
    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds + p.reaped_cpu_seconds for p in self.procs)

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.procs)

    def by_role(self) -> dict[str, list[ProcSample]]:
        roles: dict[str, list[ProcSample]] = {}
        for proc in self.procs:
            roles.setdefault(proc.role, []).append(proc)
        return roles


@dataclass
class _Tree:
    root_pid: int
    walked_at: float
    processes: list[tuple[psutil.Process, str]]


def descendants(root: int) -> list[int]:
    """Pids below ``root``, from /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN); psutil otherwise."""
    if not Path(f"/proc/{root}/task/{root}/children").exists():
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    found: list[int] = []
    pending = [root]
    while pending:
        pid = pending.pop()
        for child in _children_of(pid):
            found.append(child)
            pending.append(child)
    return found


def _children_of(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for tid in tasks:
        try:
            children.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return children


def replica_cores(replica: Replica) -> int:
    """Cores a replica may use: its CPU placement's core list, else every core the gateway may use."""
    cores = replica.placement.cores if replica.placement is not None else ()
    return len(cores) if cores else len(os.sched_getaffinity(0))


def replica_device(replica: Replica) -> str:
    return replica.placement.device if replica.placement is not None else "cpu"


class ProcessTable:
    """Snapshots of every replica's process tree, shared by the collectors of one scrape."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], *, tree_refresh_seconds: float = 10.0,
                 ttl: float = 0.5, clock: Clock = time.monotonic) -> None:
        self._replicas = replicas
        self._tree_refresh = tree_refresh_seconds
        self._ttl = ttl
        self._clock = clock
        self._trees: dict[str, _Tree] = {}
        self._snapshot: dict[str, ReplicaProcs] = {}
        self._taken_at = -float("inf")
        self.errors = 0  # processes that vanished mid-read; normal during restarts
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """Make the next ``snapshot()`` read afresh (called at the start of each scrape)."""
        self._taken_at = -float("inf")

    def snapshot(self) -> dict[str, ReplicaProcs]:
        with self._lock:
            now = self._clock()
            if now - self._taken_at >= self._ttl:
                self._snapshot = self._read_all(now)
                self._taken_at = now
            return self._snapshot

    def owners(self) -> dict[int, str]:
        """pid -> replica name, for mapping per-process readings (GPU memory, allocator files) to replicas."""
        return {proc.pid: name for name, procs in self.snapshot().items() for proc in procs.procs}

    def _read_all(self, now: float) -> dict[str, ReplicaProcs]:
        result: dict[str, ReplicaProcs] = {}
        for replica in self._replicas():
            pid = replica.status.pid
            if not pid:
                continue
            tree = self._tree(replica.name, int(pid), now)
            if tree is None:
                continue
            procs = ReplicaProcs(replica.name, int(pid), replica_cores(replica), replica_device(replica))
            for process, role in tree.processes:
                sample = self._sample(process, role)
                if sample is None:
                    tree.walked_at = -float("inf")  # something exited: walk the tree again next scrape
                    continue
                procs.procs.append(sample)
            result[replica.name] = procs
        for gone in set(self._trees) - set(result):
            del self._trees[gone]
        return result

    def _tree(self, name: str, root: int, now: float) -> _Tree | None:
        tree = self._trees.get(name)
        if tree is not None and tree.root_pid == root and now - tree.walked_at < self._tree_refresh:
            return tree
        try:
            pids = [root, *descendants(root)]
        except (psutil.Error, OSError):
            self._trees.pop(name, None)
            return None
        previous = {p.pid: p for p, _ in tree.processes} if tree is not None else {}
        processes = []
        for pid in pids:
            process = self._process(pid, previous)
            if process is not None:
                processes.append((process, self._role(process)))
        tree = self._trees[name] = _Tree(root, now, processes)
        return tree

    @staticmethod
    def _process(pid: int, previous: dict[int, psutil.Process]) -> psutil.Process | None:
        """Reuse the psutil object of a known pid (it remembers the create time that guards against pid reuse)."""
        known = previous.get(pid)
        if known is not None and known.is_running():
            return known
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None

    @staticmethod
    def _role(process: psutil.Process) -> str:
        try:
            return classify(process.cmdline())
        except psutil.Error:
            return OTHER

    def _sample(self, process: psutil.Process, role: str) -> ProcSample | None:
        try:
            with process.oneshot():
                times = process.cpu_times()
                rss = process.memory_info().rss
                created = process.create_time()
        except psutil.Error:
            self.errors += 1
            return None
        return ProcSample(process.pid, role, created, times.user + times.system,
                          times.children_user + times.children_system, rss)
