"""Where the appliance's own files are: the one definition of the source tree's root and its asset folders.

In a checkout or an editable install (``make up``) these are the repository's folders; the container image
copies the same folders next to the package (see the Dockerfile), so the same paths hold there.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ALERTS_DIR = REPO_ROOT / "alerts"
DASHBOARDS_DIR = REPO_ROOT / "dashboards"
RUNBOOKS_DIR = REPO_ROOT / "docs" / "runbooks"  # served by the gateway at /runbooks/{alertname}
DEFAULT_STATE_DIR = REPO_ROOT / "var"  # where `make up` keeps models, logs and the admin token
