"""The embedded default's admin token file: generated once into the state dir, readable by its owner only.

The file is written by ``appliance.files.atomic_write_text``: under a fresh random name created with mode 0600
and O_EXCL (``tempfile.mkstemp``), then renamed over the target, so a stale or planted temporary file (say 0644,
left by a crash) is never reused, and the token is never visible under the final name half-written. An existing
token file that is group- or world-readable is narrowed to 0600 before its token is used.
"""

from __future__ import annotations

import secrets
import stat
from pathlib import Path

from appliance.admin_client import TOKEN_FILE  # under the state dir; the admin commands read it from there
from appliance.files import atomic_write_text


def ensure_admin_token(state_dir: Path) -> str:
    """The token in ``state_dir/admin-token``, generated (32 hex digits) when the file is missing or empty."""
    path = state_dir / TOKEN_FILE
    if path.is_file() and (token := path.read_text().strip()):
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
        return token
    token = secrets.token_hex(16)
    atomic_write_text(path, token + "\n")  # mkstemp: 0600 and O_EXCL from the first byte
    return token
