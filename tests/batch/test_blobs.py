"""The files on disk: what a crash left unrecorded is swept, except, in a folder several gateways share, a file
young enough to be another gateway's write about to be recorded."""

from __future__ import annotations

import os
import time

from appliance.batch.blobs import FileBlobs

KNOWN, ORPHAN, FRESH = "file-" + "a" * 24, "file-" + "b" * 24, "file-" + "c" * 24


def test_the_sweep_removes_unrecorded_files_and_leaves_young_ones_where_asked(tmp_path):
    blobs = FileBlobs(tmp_path)
    for file_id in (KNOWN, ORPHAN, FRESH):
        blobs.write(file_id, b"{}\n")
    (tmp_path / ".tmp-upload").write_bytes(b"half")
    (tmp_path / "README").write_text("not ours")
    old = time.time() - 3600
    for name in (ORPHAN, ".tmp-upload"):
        os.utime(tmp_path / name, (old, old))
    assert blobs.sweep({KNOWN}, younger_kept=600) == 2  # the old orphan and the old temporary file
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README", KNOWN, FRESH]
    assert blobs.sweep({KNOWN}) == 1  # one host: nobody else writes here, every unrecorded file is an orphan
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README", KNOWN]
