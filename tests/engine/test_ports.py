"""Whose port is it (appliance.engine.ports), against real sockets held by real processes: a tree holding the
listening socket on a port owns it, anyone else's listener (a squatter) or a connection to the port does not.
(The engines' uid fallback is in test_engine_user.py; what the
supervisor makes of the check is in test_replica.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from appliance.engine import ports
from tests.engine.support import free_port


def spawn_tree(*listen: str) -> subprocess.Popen[str]:
    """A launcher whose child listens on ``listen`` (``host:port`` each); it runs until its stdin closes."""
    code = ("import socket, subprocess, sys\n"
            "if sys.argv[1:2] == ['child']:\n"
            "    held = []\n"
            "    for where in sys.argv[2:]:\n"
            "        host, port = where.rsplit(':', 1)\n"
            "        s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET)\n"
            "        s.bind((host, int(port)))\n"
            "        s.listen()\n"
            "        held.append(s)\n"
            "    print('up', flush=True)\n"
            "    sys.stdin.read()\n"
            "else:\n"
            "    subprocess.run([sys.executable, '-c', sys.argv[1], 'child', *sys.argv[2:]])\n")
    process = subprocess.Popen([sys.executable, "-c", code, code, *listen], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "up\n"
    return process


@pytest.fixture
def trees() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(10)


def test_the_tree_holding_the_listener_owns_the_port_and_a_squatter_does_not(trees) -> None:
    ours, theirs = free_port(), free_port()
    tree = spawn_tree(f"127.0.0.1:{ours}")
    squatter = spawn_tree(f"127.0.0.1:{theirs}")
    trees += [tree, squatter]
    assert ports.tree_listens_on(tree.pid, ours)  # held by the launcher's child
    assert not ports.tree_listens_on(tree.pid, theirs)  # someone listens there, but not this tree
    assert ports.tree_listens_on(squatter.pid, theirs)
    assert not ports.tree_listens_on(squatter.pid, ours)
    assert not ports.tree_listens_on(tree.pid, free_port())  # nobody listens there
    assert not ports.tree_listens_on(2**22 + 1, ours)  # no such process


def test_a_squatter_on_the_same_port_at_another_address_is_not_the_tree(trees) -> None:
    """The tree listens on 127.0.0.1:P, the squatter on [::1]:P: each owns the port through its own socket only."""
    port = free_port()
    squatter = spawn_tree(f"::1:{port}")
    trees.append(squatter)
    idle = spawn_tree()  # listens nowhere
    trees.append(idle)
    assert ports.tree_listens_on(squatter.pid, port)  # an IPv6 listener counts
    assert not ports.tree_listens_on(idle.pid, port)
    tree = spawn_tree(f"127.0.0.1:{port}")
    trees.append(tree)
    assert ports.tree_listens_on(tree.pid, port)
    assert len(ports.listening_sockets(port)) == 2


def test_listeners_are_the_listening_sockets_only_with_their_inodes_and_uid() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.socket(socket.AF_INET6) as server6:
            server6.bind(("::1", port))
            server6.listen()
            # connections to the port (both ends) are in the tables too, with the port on either side
            with socket.create_connection(("127.0.0.1", port)) as client, server.accept()[0] as accepted:
                expected = {os.fstat(s.fileno()).st_ino: os.getuid() for s in (server, server6)}
                assert ports.listening_sockets(port) == expected
                assert os.fstat(client.fileno()).st_ino not in ports.listening_sockets(port)
                assert os.fstat(accepted.fileno()).st_ino not in ports.listening_sockets(port)
                assert ports.listening_sockets(client.getsockname()[1]) == {}  # a client's port listens not
    assert ports.listening_sockets(port) == {}


def test_a_process_whose_fds_cannot_be_read_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not ports.holds_any(2**22 + 1, {"socket:[1]"})  # gone: not ours, not an error
    real_listdir = os.listdir

    def denied(path: str) -> list[str]:
        if path.startswith("/proc/") and path.endswith("/fd"):
            raise PermissionError(13, "Permission denied", path)
        return real_listdir(path)

    monkeypatch.setattr(ports.os, "listdir", denied)
    with pytest.raises(PermissionError):
        ports.holds_any(os.getpid(), {"socket:[1]"})
