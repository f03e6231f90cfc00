"""Fixtures for the monitoring tests: the Prometheus/Alertmanager command-line tools, or a clear skip.

Developers without the Debian packages get a skip that names the package; CI sets APPLIANCE_REQUIRE_TOOLS=1 so
that a missing tool fails instead of silently skipping the checks that matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "alerts"


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "prometheus")


@pytest.fixture(scope="session")
def amtool() -> str:
    return require_tool("amtool", "prometheus-alertmanager")


@pytest.fixture(scope="session")
def alert_rules() -> list[dict]:
    """Every alerting rule of the committed alerts/alerts.rules.yaml."""
    groups = yaml.safe_load((ALERTS / "alerts.rules.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]
