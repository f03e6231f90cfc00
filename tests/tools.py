"""External tools the tests use (promtool, amtool, Prometheus, Alertmanager, docker-compose, redis-server,
PostgreSQL's initdb and pg_ctl).

Absent on a developer's machine, the tests that need them skip with the Debian package to install; in CI
(``APPLIANCE_REQUIRE_TOOLS=1``, set by .ci/run after installing them) an absent tool is a failure, so a test
can never pass by not running.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(binary: str, package: str) -> str:
    """The tool's path; skip (or fail in CI) when it is not installed."""
    path = shutil.which(binary)
    if path:
        return path
    message = f"{binary} not found: apt-get install {package}"
    if os.environ.get("APPLIANCE_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)
