"""The user the engines run as (``engine.user``), and what that user can read.

Why: an engine is the appliance's least trusted code (vLLM, its plugins, model files run with
``trust_remote_code``). Run as the appliance's own user it can read every file the gateway reads (the admin token,
every API key) and the gateway's memory and environment through /proc. Run as a user of its own, with its own group
and no supplementary group, the kernel keeps it out of both: the secret files stay the gateway's (0600, or 0440 to
a group the engine user is not in), and /proc/<gateway pid>/environ and /mem need the gateway's uid. The appliance
keeps the power to start and stop its engines (root, or CAP_SETUID, CAP_SETGID and CAP_KILL: see
``appliance.engine.capabilities``); the engines get none. A web server's master and workers, applied to engines.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as the engine user: prints the paths (argv) it could open for reading, as JSON.
_PROBE = ("import json, os, sys\nopened = []\nfor path in sys.argv[1:]:\n    try:\n        os.close(os.open(path, "
          "os.O_RDONLY))\n    except OSError:\n        continue\n    opened.append(path)\nprint(json.dumps(opened))")


@dataclass(frozen=True)
class EngineUser:
    """A user from the password database, as the engines run: its uid, its own group only, its home."""

    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def lookup(cls, user: str) -> EngineUser:
        """``user``: a name or a numeric uid; LookupError when there is no such user."""
        try:
            entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError:
            raise LookupError(f"no user {user!r} in the password database") from None
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    @property
    def is_current(self) -> bool:
        """The appliance's own user and group: nothing to switch (and nothing separated)."""
        return self.uid == os.geteuid() and self.gid == os.getegid()

    def popen_options(self) -> dict[str, Any]:
        """``subprocess.Popen``'s: this uid and group and no supplementary group, so not the group that may hold
        the gateway's secret files (compose's 10001) either."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def env(self) -> dict[str, str]:
        """Its login variables: the gateway's HOME is not the engine's to write its caches in."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def readable(self, paths: Iterable[Path], timeout_seconds: float = 30.0) -> list[Path]:
        """The ``paths`` this user can open for reading, found by trying as this user (mode bits, ACLs, folders
        above, security modules: whatever the kernel decides for an engine decides here too). Needs the same
        privileges as starting an engine."""
        wanted = [str(path) for path in paths]
        if not wanted:
            return []
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, *wanted], capture_output=True, text=True,
                              env={"PATH": os.defpath}, cwd="/", timeout=timeout_seconds, check=True,
                              **self.popen_options())
        return [Path(path) for path in json.loads(done.stdout)]
