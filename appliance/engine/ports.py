"""Whose port is it: a replica is ready only when its own process tree listens on the replica's port.

A 200 on ``/health`` proves that *something* answers on the port, not that it is our engine: after the engine
died (or before it bound), another process can hold the port (a stale engine of an earlier run, a squatter), and
routing to it would serve someone else's answers. The check asks the kernel instead: which sockets listen on the
port, and does the launcher or one of its descendants hold one of them (an fd of theirs that reads
``socket:[inode]`` in /proc/<pid>/fd)?

It runs in the appliance's process beside the gateway's event loop, on a host whose network namespace may hold
thousands of sockets (a gateway relaying thousands of streams holds two per stream with its engines), so it looks
at the listening sockets only: /proc/net/tcp and tcp6 are read once per check (the kernel prints every socket of
the namespace, about 30 ms at 8,000 sockets), and only the lines of sockets listening on the port are split; then
each process's fds are searched from the lowest number up, ending at the first match (a server opens its
listening socket before it accepts any connection, so it is among the first few). The supervisor runs the check
when a replica's health turns OK and then at most every 30 s (appliance.engine.replica), not on every probe.
(The kernel's sock_diag netlink interface answers the same question without printing every socket; measured at
0.05 ms, but the check is rare enough that its binary protocol is not worth carrying.)

Why not an identity token passed to vLLM and checked on a request: vLLM's ``--api-key`` protects /v1 only (not
/health), and every proxied request would then have to carry it; a served-model-name check is fooled by a second
vLLM of the same model. Socket ownership needs nothing from the engine and cannot be imitated by another process.

An engine run as a user of its own (``engine.user``) keeps its sockets from an appliance without CAP_SYS_PTRACE
(/proc/<pid>/fd is the owner's to read): then the kernel says whose the listening socket is, and a listener owned
by the engines' uid (which only the appliance's engines run as) counts as the replica's own.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import psutil

SOCKET_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
# What follows a listening socket's local port in a table line: its remote address, all zeros (IPv4 and IPv6
# tables), then the LISTEN state. A connection to or from the port has a remote address, so it never matches.
LISTEN_REMOTES = (b" " + b"0" * 8 + b":0000 0A ", b" " + b"0" * 32 + b":0000 0A ")


def tree_listens_on(root_pid: int, port: int, *, owner_uid: int | None = None) -> bool:
    """True when ``root_pid`` or one of its descendants has a TCP socket listening on ``port``; where their fds
    cannot be read and ``owner_uid`` is given, when a socket owned by that uid listens on ``port``."""
    listeners = listening_sockets(port)
    if not listeners:  # nothing listens: no process needs to be looked at
        return False
    try:
        root = psutil.Process(root_pid)
        pids = [root_pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return False
    links = {f"socket:[{inode}]" for inode in listeners}
    denied = False
    for pid in pids:
        try:
            if holds_any(pid, links):
                return True
        except PermissionError:  # another user's process
            denied = True
    return denied and owner_uid is not None and owner_uid in listeners.values()


def listening_sockets(port: int) -> dict[int, int]:
    """The TCP sockets (IPv4 and IPv6) listening on ``port`` in this network namespace: each one's inode with the
    uid that owns it."""
    return table_listeners(port)


def table_listeners(port: int, tables: tuple[Path, ...] | None = None) -> dict[int, int]:
    """``listening_sockets`` from the kernel's socket tables (/proc/net/tcp and tcp6): only the lines of sockets
    listening on ``port`` are found (a byte search) and split."""
    needles = [f":{port:04X}".encode() + remote for remote in LISTEN_REMOTES]
    sockets: dict[int, int] = {}
    for table in tables or SOCKET_TABLES:
        try:
            with open(table, "rb") as file:
                text = file.read()
        except OSError:
            continue
        for needle in needles:
            at = text.find(needle)
            while at >= 0:
                start, end = text.rfind(b"\n", 0, at) + 1, text.find(b"\n", at)
                fields = text[start:end if end >= 0 else len(text)].split()
                if len(fields) > 9 and fields[3] == b"0A":  # sl, local, remote, state, queues, timer, retransmits,
                    sockets[int(fields[9])] = int(fields[7])  # uid, timeout, inode
                at = text.find(needle, at + len(needle))
    return sockets


def holds_any(pid: int, links: Collection[str]) -> bool:
    """True when process ``pid`` has an fd whose link (``socket:[inode]``) is one of ``links``, looked for from the
    lowest fd up; False when it is gone. PermissionError when its fds are not ours to read."""
    fds = f"/proc/{pid}/fd"
    try:
        names = sorted(int(name) for name in os.listdir(fds))
    except (FileNotFoundError, ProcessLookupError):
        return False
    for name in names:
        try:
            if os.readlink(f"{fds}/{name}") in links:
                return True
        except (FileNotFoundError, ProcessLookupError):  # closed meanwhile, or the process ended
            continue
    return False
