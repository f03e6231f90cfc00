"""Orphan-proof launcher: ``python -m appliance.engine.launch -- CMD...``.

vLLM's server forks an engine-core process (and on GPUs, workers) that outlive the server if it is killed hard.
This launcher runs CMD as the leader's only child inside the launcher's process group and guarantees that the
whole group goes away when either side dies:

- the appliance dies (even SIGKILL): the kernel sends us SIGTERM (PR_SET_PDEATHSIG); we stop CMD gracefully,
  then SIGKILL the group after a grace period;
- CMD dies: we SIGKILL the rest of the group (the engine core it left behind) and exit with CMD's status, so the
  supervisor sees a crash and restarts the replica;
- we are killed with SIGKILL: CMD gets SIGTERM from its own PR_SET_PDEATHSIG, and the supervisor, which knows the
  group id, SIGKILLs the group when it sees us exit.

It also gives up every Linux capability before CMD starts (appliance/engine/capabilities.py): an engine run as a
user of its own inherits the ambient ones its appliance holds to start it, and with CAP_SETUID it could become the
appliance's user again. A non-root launcher that cannot drop them refuses to start CMD.

Linux-only (prctl); elsewhere it degrades to a plain wrapper.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

from appliance.engine.capabilities import drop_all

PR_SET_PDEATHSIG = 1
GRACE_ENV = "APPLIANCE_ENGINE_GRACE_SECONDS"
PARENT_ENV = "APPLIANCE_PARENT_PID"


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_PDEATHSIG, sig)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m appliance.engine.launch -- CMD [ARGS...]", file=sys.stderr)
        return 2
    if not drop_all():  # first: a change of credentials may clear the parent-death signal
        print("appliance.engine.launch: cannot give up this process's capabilities; not starting the engine",
              file=sys.stderr)
        return 1
    set_parent_death_signal()
    expected_parent = os.environ.get(PARENT_ENV)
    if expected_parent and os.getppid() != int(expected_parent):
        return 1  # the parent died before prctl took effect: nobody wants this engine any more
    grace = float(os.environ.get(GRACE_ENV, "30"))
    child = subprocess.Popen(argv[1:], preexec_fn=set_parent_death_signal)  # noqa: PLW1509 (single-threaded)
    stopping = {"at": 0.0}

    def forward(signum: int, _frame: object) -> None:
        if not stopping["at"]:
            stopping["at"] = time.monotonic()
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = _wait(child, stopping, grace)
    _kill_group()
    return 128 - code if code < 0 else code  # a signal death reads as the shell shows it (SIGKILL: 137)


def _wait(child: subprocess.Popen[bytes], stopping: dict[str, float], grace: float) -> int:
    """Wait for the child; once a stop began, give it ``grace`` seconds, then kill it."""
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stopping["at"] and time.monotonic() - stopping["at"] > grace:
                child.kill()


def _kill_group() -> None:
    """SIGKILL every other process of our group: whatever the server left behind."""
    group, me = os.getpgrp(), os.getpid()
    for pid in _group_members(group):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _group_members(group: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == group:
                    members.append(int(entry))
            except ProcessLookupError:
                continue
    return members


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
