"""The runbooks served by the appliance itself: ``GET /runbooks/{alertname}`` answers docs/runbooks/ALERT.md.

Every alert's ``runbook_url`` and every dashboard's runbook link points here by default (``runbook_url`` in
alerts/config.yaml), so on-call reads the runbook of the running version, also where GitHub cannot be reached
(air-gapped sites). Open like /health: runbooks hold no secret. Only the names of the ``.md`` files in the
runbooks folder are served, looked up in its listing (never a path built from the request); anything else is 404.

The folder is ``docs/runbooks`` under the appliance's assets (``monitoring.assets_dir``, where the image copies
alerts, dashboards and runbooks: the installed package there lives in site-packages, away from them), else
under the source tree.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from appliance.context import Context
from appliance.paths import REPO_ROOT, RUNBOOKS_DIR

router = APIRouter(prefix="/runbooks", tags=["runbooks"])

MARKDOWN = "text/markdown; charset=utf-8"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def runbook_path(name: str, directory: Path = RUNBOOKS_DIR) -> Path | None:
    """The runbook file called ``name`` (with or without ``.md``), or None: no such runbook, or not a name."""
    stem = name.removesuffix(".md")
    if not _NAME.fullmatch(stem):
        return None
    books = {path.stem: path for path in directory.glob("*.md") if path.is_file()}
    return books.get(stem)


def runbooks_dir(assets_dir: Path | None) -> Path:
    """Where the runbooks of this installation are: beside its alerts and dashboards (``monitoring.assets_dir``;
    None: the source tree's)."""
    if assets_dir is None:
        return RUNBOOKS_DIR
    return assets_dir / RUNBOOKS_DIR.relative_to(REPO_ROOT)


def _markdown(path: Path | None) -> Response:
    if path is None:
        return PlainTextResponse("no such runbook\n", status_code=404)
    return Response(path.read_text(encoding="utf-8"), media_type=MARKDOWN)


@router.get("/", include_in_schema=False)
async def index(ctx: Context) -> Response:
    """The runbook index (docs/runbooks/README.md)."""
    return _markdown(runbook_path("README", runbooks_dir(ctx.live.settings.monitoring.assets_dir)))


@router.get("/{alertname}")
async def runbook(alertname: str, ctx: Context) -> Response:
    return _markdown(runbook_path(alertname, runbooks_dir(ctx.live.settings.monitoring.assets_dir)))
