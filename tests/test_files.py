"""Atomic files: the old file or the new one, never half, never a stray temporary, never a moment readable."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from appliance import files


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "bench.json"
    files.atomic_write_json(target, {"old": True})

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_json(target, {"new": True})
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary left behind


def test_atomic_write_of_a_failing_generator_leaves_nothing(tmp_path: Path) -> None:
    def rows() -> Any:
        yield {"a": 1}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        files.atomic_write_jsonl(tmp_path / "requests.jsonl", rows())
    assert list(tmp_path.iterdir()) == []


def test_json_has_no_nan(tmp_path: Path) -> None:
    files.atomic_write_json(tmp_path / "x.json", {"a": float("nan"), "b": [float("inf"), 1.0]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [None, 1.0]}


def test_a_secret_is_owner_only_from_the_start_and_a_shared_file_gets_its_mode(tmp_path: Path) -> None:
    files.atomic_write_text(tmp_path / "token", "secret\n")
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    files.atomic_write_text(tmp_path / "rules.yaml", "groups: []\n", mode=0o644)
    assert stat.S_IMODE((tmp_path / "rules.yaml").stat().st_mode) == 0o644


def test_replace_folder_swaps_whole_folders_and_leaves_no_debris(tmp_path):
    """A reader of ``target`` sees the old folder or the new one; nothing of either is left beside it."""
    target = tmp_path / "model"
    for generation in ("old", "new"):
        staging = tmp_path / f".model.tmp-{generation}"
        staging.mkdir()
        (staging / "weights").write_text(generation)
        files.replace_folder(staging, target)
        assert (target / "weights").read_text() == generation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_replace_folder_takes_the_place_of_an_empty_folder(tmp_path):
    target = tmp_path / "snapshot"
    target.mkdir()
    staging = tmp_path / ".snapshot.tmp"
    staging.mkdir()
    (staging / "index.html").write_text("x")
    files.replace_folder(staging, target)
    assert (target / "index.html").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["snapshot"]
