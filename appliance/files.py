"""Atomic files: a reader sees the old file or the new one, never half of it (reports, rule bundles, tokens,
the engine plugin's statistics). The one helper for it in the appliance."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` via a same-folder temporary file, fsync and rename. The temporary file is
    created owner-only (mkstemp), so ``mode`` (e.g. 0o644 for a shared file) is applied before the rename and a
    secret is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def atomic_write_json(path: Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(_clean(data), indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(_clean(row)) + "\n" for row in rows))


def replace_folder(staging: Path, target: Path) -> None:
    """Swap a finished folder into place: a reader sees the old folder or the new one, never half of one (model
    checkpoints, snapshots). ``staging`` must be on ``target``'s filesystem (a sibling) so the rename is atomic; an
    existing ``target`` is moved aside first and deleted only once the new one is in place."""
    old = None
    if target.exists():
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
