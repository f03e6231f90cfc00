"""The Batch API's files on disk: one file per id, written whole or not at all.

Each is written to a temporary file in the same folder, fsynced and renamed into place (``appliance.files``),
then the folder is fsynced so the rename itself survives a power loss. The database records a file only after it
is on disk and forgets it before it is removed, so a crash between the two leaves at worst a file nobody refers to:
``sweep`` removes those at start.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Collection
from pathlib import Path

from appliance.files import atomic_write_bytes

log = logging.getLogger(__name__)
_ID = re.compile(r"^file-[0-9a-f]{24}$")


class FileBlobs:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, file_id: str) -> Path:
        if not _ID.match(file_id):  # ids are made here; anything else never reaches the disk
            raise ValueError(f"not a file id: {file_id!r}")
        return self.folder / file_id

    def write(self, file_id: str, data: bytes) -> None:
        atomic_write_bytes(self.path(file_id), data)
        self._sync_folder()

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def remove(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def sweep(self, known: Collection[str], *, younger_kept: float = 0.0) -> int:
        """Remove what a crash left: files the database does not know, and temporary files. Returns how many.
        ``younger_kept``: files modified less than this many seconds ago stay (a folder several gateways share may
        hold one another gateway is writing, or has written and is about to record)."""
        if not self.folder.is_dir():
            return 0
        removed = 0
        settled = time.time() - younger_kept
        for entry in self.folder.iterdir():
            if entry.name in known or not (entry.name.startswith(".") or _ID.match(entry.name)):
                continue
            if younger_kept > 0 and _modified(entry) > settled:
                continue
            entry.unlink(missing_ok=True)
            removed += 1
        if removed:
            log.info("batch files: removed %d file(s) a crash left unrecorded in %s", removed, self.folder)
        return removed

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _modified(entry: Path) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:  # gone meanwhile (renamed into place, or removed by another gateway)
        return 0.0
