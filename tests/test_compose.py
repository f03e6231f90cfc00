"""compose.yaml: valid for a real docker-compose, and the production properties an SRE relies on."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from appliance.settings import Settings
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_ENV = {"GRAFANA_ADMIN_PASSWORD": "pw", "APPLIANCE_ADMIN_TOKEN": "token"}


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    compose = require_tool("docker-compose", "docker-compose")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "GRAFANA_", "COMPOSE_"))}
    return subprocess.run([compose, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True, text=True,
                          env={**clean, **env}, cwd=ROOT)


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    result = _compose_config(REQUIRED_ENV)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def _mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) per volume; docker-compose 1.x prints the short string form."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts.append((source, target, mode == ["ro"]))
        else:
            mounts.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return mounts


def _seconds(value: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([smh])", value))


def test_secrets_are_required_not_defaulted() -> None:
    result = _compose_config({"APPLIANCE_ADMIN_TOKEN": "token"})
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_gpu_appliance_reserves_nvidia_devices_and_cpu_profile_runs_the_cpu_build(services) -> None:
    gpu, cpu = services["appliance"], services["appliance-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert cpu["build"]["args"]["ENGINE_BUILD"] == "cpu" and cpu["environment"]["APPLIANCE_DEVICE"] == "cpu"
    assert (ROOT / ".env").read_text().count("COMPOSE_PROFILES=gpu") == 1  # plain `docker compose up`: GPU


def test_appliance_drains_before_docker_kills_it(services) -> None:
    drain = Settings().drain_timeout_seconds
    for name in ("appliance", "appliance-cpu"):
        service = services[name]
        assert _seconds(service["stop_grace_period"]) > drain
        assert service["environment"]["APPLIANCE_DRAIN_TIMEOUT_SECONDS"] == str(int(drain))
        assert service["healthcheck"]["test"][-1].endswith("/health/ready")
        assert any(target.endswith("/models") for _, target, _ in _mounts(service))


def test_monitoring_services_read_the_rendered_bundle_and_have_health_checks(services) -> None:
    config = services["monitoring-config"]
    assert config["entrypoint"][:2] == ["appliance", "monitoring-config"]
    for name in ("prometheus", "alertmanager"):
        service = services[name]
        assert service["depends_on"]["monitoring-config"]["condition"] == "service_completed_successfully"
        assert any(source == "monitoring-config" and ro for source, _, ro in _mounts(service))
    for name in ("prometheus", "alertmanager", "grafana"):
        assert "healthcheck" in services[name], name


def test_grafana_has_no_anonymous_access_and_is_provisioned(services) -> None:
    grafana = services["grafana"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw"
    targets = {target for _, target, _ in _mounts(grafana)}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= targets
    assert (ROOT / "dashboards" / "provisioning" / "datasources").is_dir()


def test_the_image_carries_the_monitoring_assets() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY alerts ./alerts" in dockerfile and "COPY dashboards ./dashboards" in dockerfile
    assert "APPLIANCE_MONITORING__ASSETS_DIR=/opt/appliance" in dockerfile
