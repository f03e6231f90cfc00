"""An engine's process tree, against a stand-in of three layers (launcher, server, engine core): SIGABRT reaches
one layer at a time and never the launcher, and the description names every process of the tree.
(A hung start ending through them, stacks in its log, is in test_replica_lifecycle.py.)"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from appliance.engine.process_tree import abort_processes, describe_tree

# Each layer starts the next, then waits for it and writes how it ended into a file named after its layer (a
# grandchild's end cannot be read from above); core files are off, SIGABRT would write one.
LAYER = """
import os, resource, subprocess, sys, time
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
below, out = sys.argv[2:], sys.argv[-1]
if below[:-1]:
    code = subprocess.Popen([sys.executable, __file__, *below]).wait()
    with open(f"{out}/exit.tmp", "w") as file:
        file.write(str(code))
    os.rename(f"{out}/exit.tmp", f"{out}/{below[0]}.exit")
time.sleep(60)
"""


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[psutil.Process, Path]]:
    script = tmp_path / "layer.py"
    script.write_text(LAYER)
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", "server", "core", str(tmp_path)])
    root = psutil.Process(launcher.pid)
    deadline = time.monotonic() + 30
    while len(root.children(recursive=True)) < 2:
        assert time.monotonic() < deadline, "the stand-in tree did not come up"
        time.sleep(0.05)
    try:
        yield root, tmp_path
    finally:
        for process in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        launcher.wait()


def ended(out: Path, layer: str) -> int | None:
    """How ``layer`` ended (its exit code as its parent saw it), or None while it runs."""
    deadline = time.monotonic() + 10
    while not (out / f"{layer}.exit").exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return int((out / f"{layer}.exit").read_text())


def test_the_layers_below_the_server_go_first_then_the_server_and_never_the_launcher(tree) -> None:
    root, out = tree
    abort_processes(root.pid, server=False)
    assert ended(out, "core") == -signal.SIGABRT
    assert not (out / "server.exit").exists()

    abort_processes(root.pid, server=True)
    assert ended(out, "server") == -signal.SIGABRT
    assert root.is_running() and root.status() != psutil.STATUS_ZOMBIE


def test_the_description_names_every_process_with_its_state_and_wait(tree) -> None:
    root, _ = tree
    described = describe_tree(root.pid)
    pids = [root.pid, *(child.pid for child in root.children(recursive=True))]
    assert [line.split()[1] for line in described] == [str(pid) for pid in pids]
    assert all(" in " in line and "thread(s): " in line and "layer.py" in line for line in described)


def test_the_description_says_how_much_cpu_each_process_used() -> None:
    """A hung start's processes: one that spins shows about all the time it had, one never scheduled none."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        process = psutil.Process(spinner.pid)
        while sum(process.cpu_times()[:2]) < 0.3:
            time.sleep(0.05)
        (line,) = describe_tree(spinner.pid)
        cpu = float(line.split(", ")[1].removesuffix("s CPU"))
        assert cpu >= 0.3, line
    finally:
        spinner.kill()
        spinner.wait()


def test_a_tree_that_is_gone_is_said_so_and_not_signalled() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert describe_tree(gone.pid) == [f"pid {gone.pid} gone"]
    abort_processes(gone.pid, server=True)  # nothing to signal: no error
