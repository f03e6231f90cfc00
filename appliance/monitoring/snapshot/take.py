"""Taking a snapshot: the dashboard JSON, the queries, the rendering, then the finished folder renamed into place
(``--out`` is either absent, the previous snapshot, or this one complete)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.files import replace_folder
from appliance.monitoring.config import MonitoringConfigError
from appliance.monitoring.dashboards import DASHBOARDS, DASHBOARDS_DIR
from appliance.monitoring.snapshot.query import Prometheus, run_queries
from appliance.monitoring.snapshot.render import write_snapshot
from appliance.monitoring.snapshot.timerange import SnapshotError, TimeRange


def load_dashboard(uid: str, directory: Path | None) -> dict[str, Any]:
    """The dashboard JSON from ``directory`` (a file named after the uid, or any file with that uid); the
    generated one when the folder does not have it (an installed package has no dashboards/ folder)."""
    folder = directory or DASHBOARDS_DIR
    candidates = [folder / f"{uid}.json"] + sorted(folder.glob("*.json")) if folder.is_dir() else []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            board = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        if isinstance(board, dict) and board.get("uid") == uid:
            return board
    if directory is None and uid in DASHBOARDS:
        try:
            return DASHBOARDS[uid](None)
        except MonitoringConfigError as exc:
            raise SnapshotError(f"cannot generate dashboard {uid!r}: {exc}") from None
    found = (_uid_of(p) for p in candidates if p.is_file())
    known = sorted({*DASHBOARDS, *(u for u in found if u is not None)})
    raise SnapshotError(f"unknown dashboard {uid!r}; known: {', '.join(known)}")


def _uid_of(path: Path) -> str | None:
    try:
        uid: str | None = json.loads(path.read_text()).get("uid")
        return uid
    except (OSError, ValueError, AttributeError):
        return None


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise SnapshotError(f"{out} already exists and is not an empty folder (use --overwrite to replace it)")


@dataclass(frozen=True)
class SnapshotRequest:
    prometheus: str
    dashboard: str
    out: Path
    start: str = "-1h"
    end: str = "now"
    step: str | None = None
    rate_interval: str | None = None
    scrape_interval: float = 15.0
    variables: Mapping[str, str] = field(default_factory=dict)
    dashboards_dir: Path | None = None
    timeout: float = 30.0
    overwrite: bool = False


def snapshot(request: SnapshotRequest, *, now: float | None = None) -> dict[str, Any]:
    """Take the snapshot; returns the results.json document. Raises SnapshotError before writing anything."""
    span = TimeRange.resolve(request.start, request.end, step=request.step, rate_interval=request.rate_interval,
                             scrape_interval=request.scrape_interval,
                             now=now if now is not None else datetime.now(UTC).timestamp())
    board = load_dashboard(request.dashboard, request.dashboards_dir)
    _prepare_out(request.out, request.overwrite)
    variables = {k: v for k, v in request.variables.items()}
    with Prometheus(request.prometheus, timeout=request.timeout) as prometheus:
        prometheus.check()
        results = run_queries(board, prometheus, span, variables)
    request.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.tmp-", dir=request.out.parent))
    try:
        document = write_snapshot(staging, board, results, span, request.prometheus, variables)
        replace_folder(staging, request.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return document
