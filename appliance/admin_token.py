"""The embedded default's admin token file: generated once into the state dir, readable by its owner only.

The file is written under a fresh random name created with mode 0600 and O_EXCL (``tempfile.mkstemp``), then
renamed over the target: a stale or planted temporary file (say 0644, left by a crash) is never reused, and the
token is never visible under the final name half-written. An existing token file that is group- or
world-readable is narrowed to 0600 before its token is used.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from appliance.admin_client import TOKEN_FILE  # under the state dir; the admin commands read it from there


def ensure_admin_token(state_dir: Path) -> str:
    """The token in ``state_dir/admin-token``, generated (32 hex digits) when the file is missing or empty."""
    path = state_dir / TOKEN_FILE
    if path.is_file() and (token := path.read_text().strip()):
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
        return token
    token = secrets.token_hex(16)
    write_private(path, token + "\n")
    return token


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, owner read/write only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600, O_EXCL, unique name
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
