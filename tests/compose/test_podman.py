"""The compose harness' podman checks, without podman: the network backend is named, and anything but netavark is
refused before a container starts, with the fix in the message (a machine without netavark ran the stack on CNI,
where Prometheus could not resolve `alertmanager`)."""

from __future__ import annotations

import tomllib

import pytest

from tests.compose import podman


def test_the_harness_configuration_names_netavark(tmp_path) -> None:
    conf = tomllib.loads(podman.containers_conf(tmp_path / "containers.conf").read_text())
    assert conf["network"]["network_backend"] == "netavark"


@pytest.mark.parametrize("backend", ["cni", "", "cni\n"])
def test_a_backend_without_name_resolution_is_refused_with_the_fix(backend: str) -> None:
    problem = podman.network_backend_problem(backend)
    assert problem is not None and "apt-get install netavark aardvark-dns" in problem


def test_netavark_passes() -> None:
    assert podman.network_backend_problem("netavark\n") is None


def test_missing_helpers_are_a_reason_not_to_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(podman, "PODMAN_HELPERS", tmp_path)
    monkeypatch.setattr(podman.shutil, "which", lambda name: f"/usr/bin/{name}")
    reason = podman.cannot_run_reason()
    assert reason is not None and "netavark" in reason and "scripts/setup-tools" in reason
