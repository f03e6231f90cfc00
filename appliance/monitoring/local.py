"""`appliance up`'s local Prometheus and Alertmanager: child processes with the compose stack's configuration.

They are helpers, not the service: a missing binary or a port already taken is a warning and the appliance
serves anyway. They die with the appliance even when it is killed hard (parent-death signal), and are stopped
gracefully after the gateway has drained, so the last alerts of a shutdown still get out.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from appliance.engine.launch import set_parent_death_signal
from appliance.monitoring.bundle import Bundle
from appliance.monitoring.settings import MonitoringSettings

log = logging.getLogger(__name__)

# Renders the bundle into a folder for Prometheus and Alertmanager at the given addresses (Alertmanager None: not
# running). The composition layer binds what else it holds (the gateway's address and tokens, the assets folder).
BundleWriter = Callable[[Path, str | None, str], Bundle]


@dataclass
class Service:
    name: str
    url: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class LocalMonitoring:
    """Prometheus and Alertmanager next to the gateway, on 127.0.0.1, keeping their data under ``state_dir``."""

    monitoring: MonitoringSettings
    state_dir: Path
    write_bundle: BundleWriter
    services: list[Service] = field(default_factory=list)

    def plan(self) -> list[Service]:
        """The services whose binaries exist, with their command lines; renders the bundle they read."""
        cfg, state = self.monitoring, self.state_dir.resolve()
        prometheus = shutil.which(cfg.prometheus_binary)
        alertmanager = shutil.which(cfg.alertmanager_binary) or shutil.which("alertmanager")
        if prometheus is None:
            log.warning("monitoring: no %s binary (apt-get install prometheus); serving without it",
                        cfg.prometheus_binary)
            return []
        am_address = f"127.0.0.1:{cfg.alertmanager_port}" if alertmanager else None
        prom_address = f"127.0.0.1:{cfg.prometheus_port}"
        bundle = self.write_bundle(state / "monitoring", am_address, prom_address)
        services = [Service("prometheus", f"http://{prom_address}", prometheus_argv(prometheus, bundle, state, cfg),
                            state / "logs" / "prometheus.log")]
        if alertmanager:
            services.append(Service("alertmanager", f"http://{am_address}",
                                    alertmanager_argv(alertmanager, bundle, state, cfg.alertmanager_port),
                                    state / "logs" / "alertmanager.log"))
        else:
            log.warning("monitoring: no Alertmanager binary (apt-get install prometheus-alertmanager); "
                        "alerts are evaluated but not routed")
        return services

    def start(self, ready_timeout: float = 20.0) -> list[Service]:
        """Start what :meth:`plan` finds; returns the services that came up ready."""
        self.services = self.plan()
        for service in self.services:
            service.log_path.parent.mkdir(parents=True, exist_ok=True)
            with service.log_path.open("ab") as out:
                # Main thread: the parent-death signal follows the thread that forked, not the process.
                service.proc = subprocess.Popen(service.argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, preexec_fn=set_parent_death_signal)  # noqa: PLW1509
        return [s for s in self.services if _wait_ready(s, ready_timeout)]

    def stop(self, timeout: float = 10.0) -> None:
        for service in self.services:
            if service.proc and service.proc.poll() is None:
                service.proc.terminate()
        for service in self.services:
            if service.proc:
                try:
                    service.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    service.proc.kill()
                    service.proc.wait()


def prometheus_argv(binary: str, bundle: Bundle, state: Path, cfg: MonitoringSettings) -> list[str]:
    """No ``--web.enable-lifecycle``: on 127.0.0.1 any local user could ``POST /-/quit`` or ``/-/reload``. Nothing
    here reloads Prometheus; should something need to, SIGHUP from the parent does it without that API."""
    return [binary, f"--config.file={bundle.prometheus_config}", f"--storage.tsdb.path={state / 'prometheus'}",
            f"--storage.tsdb.retention.time={cfg.retention}", f"--web.listen-address=127.0.0.1:{cfg.prometheus_port}"]


def alertmanager_argv(binary: str, bundle: Bundle, state: Path, port: int) -> list[str]:
    # An empty cluster address turns off the gossip listener: one local Alertmanager has no peers.
    return [binary, f"--config.file={bundle.alertmanager_config}", f"--storage.path={state / 'alertmanager'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]


def _wait_ready(service: Service, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc and service.proc.poll() is not None:
            log.warning("monitoring: %s exited with %s (see %s)", service.name, service.proc.returncode,
                        service.log_path)
            return False
        try:
            if httpx.get(f"{service.url}/-/ready", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    log.warning("monitoring: %s not ready after %.0fs (see %s)", service.name, timeout, service.log_path)
    return False
