"""An engine's process tree, for ending a start that hangs: signal its layers in order, and say what each process
is doing.

Below the launcher (``appliance.engine.launch``) an engine is a tree: the launcher, its child the API server, and
below the server the engine core and its workers. Engines run with PYTHONFAULTHANDLER, so a SIGABRT makes a
process write every thread's Python stack into the log as it dies; the layers are told apart because the server
must go last (when it dies, the launcher kills the rest of its group at once, dumps written or not). Each
process's state and kernel wait channel go into the log beside the stacks. ``appliance.engine.replica`` decides
when a start hangs and when each step comes; this module only reads and signals the tree.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import psutil


def abort_processes(root_pid: int, *, server: bool) -> None:
    """SIGABRT to the launcher's (``root_pid``'s) children, the server (``server``), or to every process below
    them (not ``server``); the launcher itself is never signalled."""
    try:
        root = psutil.Process(root_pid)
        tree = root.children(recursive=True)
    except psutil.Error:
        return
    depth = {root_pid: 0}
    for process in tree:  # psutil lists a parent before its children
        with contextlib.suppress(psutil.Error):
            depth[process.pid] = depth.get(process.ppid(), 0) + 1
    for process in tree:
        if (depth.get(process.pid, 1) == 1) == server:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGABRT)


def describe_tree(root_pid: int) -> list[str]:
    """Each process of an engine's tree with its state, where the kernel has it wait and the CPU time it used:
    what a hung start leaves in the logs for whoever finds out why."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return [f"pid {root_pid} gone"]
    described = []
    for process in processes:
        try:
            with process.oneshot():
                command = " ".join(process.cmdline()[:4])
                state, threads = process.status(), process.num_threads()
                times = process.cpu_times()
        except psutil.Error:
            continue
        try:
            wchan = Path(f"/proc/{process.pid}/wchan").read_text().strip() or "-"
        except OSError:
            wchan = "?"
        # CPU seconds tell a spin (about all the time it had) from a process the scheduler left runnable
        cpu = times.user + times.system
        described.append(f"pid {process.pid} {state} in {wchan}, {cpu:.1f}s CPU, {threads} thread(s): {command}")
    return described
