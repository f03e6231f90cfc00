"""Whose port is it: a replica is ready only when its own process tree listens on the replica's port.

A 200 on ``/health`` proves that *something* answers on the port, not that it is our engine: after the engine
died (or before it bound), another process can hold the port (a stale engine of an earlier run, a squatter), and
routing to it would serve someone else's answers. The check asks the kernel instead (via psutil: each process's
sockets from /proc): does the launcher or one of its descendants hold a listening socket on the port?

Why not an identity token passed to vLLM and checked on a request: vLLM's ``--api-key`` protects /v1 only (not
/health), and every proxied request would then have to carry it; a served-model-name check is fooled by a second
vLLM of the same model. Socket ownership needs nothing from the engine and cannot be imitated by another process.
"""

from __future__ import annotations

import psutil


def tree_listens_on(root_pid: int, port: int) -> bool:
    """True when ``root_pid`` or one of its descendants has a TCP socket listening on ``port``."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return False
