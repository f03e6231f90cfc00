"""A real PostgreSQL for the batch store's tests: a throwaway cluster (``initdb``) in a folder of its own, on a free
port of the loopback, with password authentication over TCP (the store reads its password from a file, as an
operator's does), no fsync (the tests prove claims and idempotence, not the disk; a commit still reaches the OS
before it returns, so it survives the server being killed), stopped and removed at teardown.

One cluster serves the whole session (initdb and start take about a second); each test takes a schema of its own
(``batch.database_schema``), which is all that keeps two stores apart. PostgreSQL refuses to run as root: under
root the cluster runs as the ``postgres`` user Debian's package creates.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.gateway.redis_server import free_port
from tests.tools import require_tool

USER = "appliance"


def _bin_dir() -> Path:
    """Debian keeps the server's programs in /usr/lib/postgresql/<major>/bin, off PATH: the newest there, or
    pg_ctl on PATH."""
    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda path: int(path.parts[-3]))
    pg_ctl = installed[-1] if installed else Path(require_tool("pg_ctl", "postgresql"))
    return pg_ctl.resolve().parent


class PostgresServer:
    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.port = free_port()
        self.password = secrets.token_hex(16)
        self._as: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                pytest.skip("PostgreSQL will not run as root, and runuser is missing to run it as postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self.directory = Path(tempfile.mkdtemp(prefix="appliance-pg-"))
        self.data = self.directory / "data"
        self.password_file = self.directory / "password"

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def start(self) -> PostgresServer:
        self.password_file.write_text(self.password + "\n")
        if self._as:
            shutil.chown(self.directory, "postgres", "postgres")
            shutil.chown(self.password_file, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", USER, f"--pwfile={self.password_file}", "-A",
                  "scram-sha-256", "-E", "UTF8", "--no-sync", "--no-instructions")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.directory} -c fsync=off "
                   "-c full_page_writes=off -c max_connections=50")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.directory / "server.log"), "-o", options, "-w",
                  "-t", "30", "start")
        return self

    def restart(self) -> None:
        """Stopped at once (every connection cut, as a crash or a failover does) and started again."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.directory / "server.log"), "-m", "immediate", "-w",
                  "-t", "30", "restart")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self, program: str, *args: str, check: bool = True) -> None:
        done = subprocess.run([*self._as, str(self.bin / program), *args], capture_output=True, text=True,
                              timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
