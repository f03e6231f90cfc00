"""Whose port is it: a replica is ready only when its own process tree listens on the replica's port.

A 200 on ``/health`` proves that *something* answers on the port, not that it is our engine: after the engine
died (or before it bound), another process can hold the port (a stale engine of an earlier run, a squatter), and
routing to it would serve someone else's answers. The check asks the kernel instead (via psutil: each process's
sockets from /proc): does the launcher or one of its descendants hold a listening socket on the port?

Why not an identity token passed to vLLM and checked on a request: vLLM's ``--api-key`` protects /v1 only (not
/health), and every proxied request would then have to carry it; a served-model-name check is fooled by a second
vLLM of the same model. Socket ownership needs nothing from the engine and cannot be imitated by another process.

An engine run as a user of its own (``engine.user``) keeps its sockets from an appliance without CAP_SYS_PTRACE
(/proc/<pid>/fd is the owner's to read): then the kernel's socket table says whose the listening socket is, and
a listener owned by the engines' uid (which only the appliance's engines run as) counts as the replica's own.
"""

from __future__ import annotations

from pathlib import Path

import psutil

TCP_LISTEN = "0A"  # the state column of /proc/net/tcp
SOCKET_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def tree_listens_on(root_pid: int, port: int, *, owner_uid: int | None = None) -> bool:
    """True when ``root_pid`` or one of its descendants has a TCP socket listening on ``port``; where their sockets
    cannot be read and ``owner_uid`` is given, when a socket owned by that uid listens on ``port``."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    denied = False
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.AccessDenied:  # another user's process
            denied = True
            continue
        except psutil.Error:  # gone meanwhile
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return denied and owner_uid is not None and owner_uid in listener_uids(port)


def listener_uids(port: int, tables: tuple[Path, ...] | None = None) -> set[int]:
    """The uids owning a TCP socket that listens on ``port``, from the kernel's socket tables."""
    uids: set[int] = set()
    for table in tables or SOCKET_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[3] == TCP_LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                uids.add(int(fields[7]))
    return uids
