"""Linux capabilities, read and dropped: the few an appliance needs to run its engines as another user, and none
for the engines.

Why: an appliance that runs its engines as a user of their own (``engine.user``) needs CAP_SETUID and CAP_SETGID
to start them as that user and CAP_KILL to stop them (or root, which has them). The image's entrypoint gives the
appliance exactly these as *ambient* capabilities (setpriv), and ambient capabilities pass through ``execve`` to
every child: the appliance clears its ambient set at start (``clear_ambient``), so that nothing it starts inherits
them, and the engine launcher drops whatever it still holds before vLLM starts (``drop_all``), so that no engine
process can become the appliance's user again. Reads /proc/self/status; Linux-only, a no-op elsewhere.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7
#: What starting and stopping engines as another user takes.
ENGINE_USER_CAPABILITIES = {"CAP_SETUID": CAP_SETUID, "CAP_SETGID": CAP_SETGID, "CAP_KILL": CAP_KILL}
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def capability_sets(status: Path = Path("/proc/self/status")) -> dict[str, int]:
    """``CapInh``, ``CapPrm``, ``CapEff``, ``CapBnd``, ``CapAmb`` of this process as bit masks (empty: no /proc)."""
    try:
        lines = status.read_text().splitlines()
    except OSError:
        return {}
    return {name: int(value, 16) for name, _, value in (line.partition(":\t") for line in lines)
            if name.startswith("Cap") and value}


def missing_for_engine_user(sets: dict[str, int] | None = None) -> list[str]:
    """The capabilities this process lacks to start and stop processes as another user (empty: it can)."""
    effective = (capability_sets() if sets is None else sets).get("CapEff", 0)
    return [name for name, bit in ENGINE_USER_CAPABILITIES.items() if not effective >> bit & 1]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def clear_ambient() -> None:
    """Empty this thread's ambient set: children started from here on inherit no capability through exec."""
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_all() -> bool:
    """Give up every capability (effective, permitted, inheritable, ambient) for good; True when none is left.

    A process that is not root may always lower its own sets. Root keeps its own: an engine run as root on
    purpose (no ``engine.user``, an appliance run as root) is the operator's choice, not this function's."""
    if os.getuid() == 0:
        return True
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
        libc.capset(ctypes.byref(header), data)
    sets = capability_sets()
    return not any(sets.get(name, 0) for name in ("CapEff", "CapPrm", "CapInh", "CapAmb"))
