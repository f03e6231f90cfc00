"""The dashboard files: canonical JSON text, written whole, and ``--write`` / ``--check``.

    python -m appliance.monitoring.dashboards --write   # rewrite dashboards/*.json
    python -m appliance.monitoring.dashboards --check   # exit 1 with a diff when they are stale (CI)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.monitoring import files
from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import resolve
from appliance.monitoring.dashboards.catalogue import build_dashboards
from appliance.paths import DASHBOARDS_DIR


def render(board: dict[str, Any]) -> str:
    """The canonical file text: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def generated(config: MonitoringConfig | None = None) -> dict[str, str]:
    """File name -> text for every dashboard."""
    return {f"{uid}.json": render(board) for uid, board in build_dashboards(resolve(config)).items()}


def stale(directory: Path, config: MonitoringConfig | None = None) -> list[str]:
    """Unified diffs of every committed file that differs from the generated one (missing files included)."""
    return files.stale_diffs(generated(config), directory)


def write(directory: Path, config: MonitoringConfig | None = None) -> list[Path]:
    return files.write_files(generated(config), directory)


def main(argv: Sequence[str] | None = None) -> int:
    return files.generator_main(argv, prog="python -m appliance.monitoring.dashboards",
                                description="Generate the Grafana dashboards (dashboards/*.json).",
                                dir_flag="--dir", default_dir=DASHBOARDS_DIR, render=generated)
