"""compose.yaml brought up for real: images built (and cached), the CPU profile with Prometheus and Alertmanager,
driven by docker-compose 1.29 through podman (see tests/compose/podman.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

from tests.compose.podman import BASE_IMAGE, Podman, inputs_hash
from tests.integration.conftest import live_assets
from tests.integration.harness import free_port_range

REPO = Path(__file__).resolve().parents[2]
# Set through the operator's env file (compose.yaml's env_file, APPLIANCE_ENV_FILE), not compose.yaml's own list:
# (they were silently dropped before). Not the defaults (demo, 1024), so that the defaults cannot pass for them;
# the length stays within the demo model's 1024 positions and above the drain test's 1000 generated tokens.
SERVED_MODEL_NAME = "demo-compose"
MAX_MODEL_LEN = 1016
EXTRA_ARGS = "--enforce-eager"  # engines start in a third of the time (tests/integration/harness.py)
IMAGES = Path(__file__).resolve().parent / "images"
SERVICES = ["appliance-cpu", "prometheus", "alertmanager"]  # Grafana: no Debian package; see test_compose.py


@dataclass
class Timings:
    """Seconds per phase, for the report (the test's cold and warm cost in CI)."""

    phases: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, started: float) -> None:
        self.phases[name] = round(time.monotonic() - started, 1)
        print(f"compose test: {name} {self.phases[name]:.1f}s", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where the compose tests keep what outlives a run (podman's configuration, timings, logs)."""
    return Path(os.environ.get("APPLIANCE_TEST_CACHE", REPO / "var" / "test-cache")) / "compose"


def build_wheelhouse() -> Path:
    """REPO/wheelhouse from scripts/build-wheelhouse with this interpreter (the images' Python, 3.11); it does
    nothing when the wheelhouse is up to date with pyproject.toml."""
    subprocess.run([str(REPO / "scripts" / "build-wheelhouse")], cwd=REPO, check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    return REPO / "wheelhouse"


def build_images(podman: Podman, cache: Path, timings: Timings) -> None:
    """The base image, the wheelhouse, the appliance images and the Prometheus/Alertmanager stand-ins, each
    rebuilt only when its inputs changed."""
    started = time.monotonic()
    podman.ensure_base_image(cache)
    timings.record("base image", started)
    started = time.monotonic()
    build_wheelhouse()
    timings.record("wheelhouse", started)
    started = time.monotonic()
    key = inputs_hash([REPO / p for p in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "appliance",
                                          "alerts", "dashboards", "deploy/image", "wheelhouse/INDEX")],
                      extra=BASE_IMAGE)
    for tag, target, args in (("appliance:cpu", "appliance", {"ENGINE_BUILD": "cpu"}),
                              ("appliance:config", "config", {})):
        podman.build(tag, REPO, key, target=target, args={"BASE_IMAGE": BASE_IMAGE, **args})
    timings.record("appliance images", started)
    started = time.monotonic()
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    for service in ("prometheus", "alertmanager"):
        dockerfile = IMAGES / f"{service}.Dockerfile"
        podman.build(compose[service]["image"], IMAGES, inputs_hash([dockerfile], extra=BASE_IMAGE),
                     dockerfile=dockerfile, args={"BASE_IMAGE": BASE_IMAGE})
    timings.record("monitoring stand-in images", started)
    started = time.monotonic()
    podman.prune_images()
    timings.record("prune", started)


@dataclass
class ComposeStack:
    podman: Podman
    workdir: Path
    project: str = field(default_factory=lambda: f"appliance-test-{secrets.token_hex(3)}")
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    # One credential per role, each a file under secrets_dir, as docs/compose.md has the operator do.
    alerts_token: str = field(default_factory=lambda: secrets.token_hex(16))
    metrics_token: str = field(default_factory=lambda: secrets.token_hex(16))
    api_key: str = field(default_factory=lambda: secrets.token_hex(16))
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = free_port_range(3)
        self.ports = {"APPLIANCE_PORT": base, "PROMETHEUS_PORT": base + 1, "ALERTMANAGER_PORT": base + 2}
        self.override = self._write_override()
        # Only what env() passes: a developer's own .env beside compose.yaml (untracked; it may name a real model
        # or secrets) must not change the stack under test. docker-compose reads it unless given another file.
        self.env_file = self.workdir / "empty.env"
        self.env_file.write_text("")
        self.secrets_dir = self._write_secrets()
        self.appliance_env_file = self.workdir / "appliance.env"
        self.appliance_env_file.write_text(f"APPLIANCE_SERVED_MODEL_NAME={SERVED_MODEL_NAME}\n"
                                           f"APPLIANCE_ENGINE__MAX_MODEL_LEN={MAX_MODEL_LEN}\n"
                                           f"APPLIANCE_ENGINE__EXTRA_ARGS={EXTRA_ARGS}\n")

    def _write_secrets(self) -> Path:
        """docs/compose.md's layout: root-owned files the image's group (10001) can read, nobody else (0440)."""
        folder = self.workdir / "secrets"
        folder.mkdir(mode=0o700, exist_ok=True)
        values = {"admin-token": self.admin_token, "alerts-token": self.alerts_token,
                  "metrics-token": self.metrics_token, "api-keys": f"# clients\n{self.api_key}\n"}
        for name, value in values.items():
            path = folder / name
            path.write_text(value + ("" if value.endswith("\n") else "\n"))
            os.chown(path, 0, 10001)
            path.chmod(0o440)
        return folder

    @property
    def client_headers(self) -> dict[str, str]:
        """What a client sends: compose always has API keys."""
        return {"authorization": f"Bearer {self.api_key}"}

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['APPLIANCE_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}"

    @property
    def alertmanager(self) -> str:
        return f"http://127.0.0.1:{self.ports['ALERTMANAGER_PORT']}"

    def _write_override(self) -> Path:
        """The only test-specific changes: `for:` of ApplianceReplicaNotReady in seconds and a 1 s scrape (as
        tests/integration do), so that an engine crash fires and resolves within one restart."""
        assets = self.workdir / "assets"
        shutil.rmtree(assets, ignore_errors=True)
        assets.mkdir(parents=True)
        live_assets(assets)
        (assets / "dashboards").unlink()
        shutil.copytree(REPO / "dashboards", assets / "dashboards")
        override = {"services": {"monitoring-config": {
            "environment": {"APPLIANCE_MONITORING__ASSETS_DIR": "/test-assets",
                            "APPLIANCE_MONITORING__SCRAPE_INTERVAL_SECONDS": "1"},
            "volumes": [f"{assets}:/test-assets:ro"],
        }}}
        path = self.workdir / "compose.test.yaml"
        path.write_text(yaml.safe_dump(override))
        return path

    def env(self) -> dict[str, str]:
        clean = {k: v for k, v in self.podman.env.items()
                 if not k.startswith(("APPLIANCE_", "GRAFANA_", "COMPOSE_", "PROMETHEUS_", "MONITORING_"))}
        return {**clean, "COMPOSE_PROFILES": "cpu", "APPLIANCE_SECRETS_DIR": str(self.secrets_dir),
                "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(8), "APPLIANCE_ENV_FILE": str(self.appliance_env_file),
                **{k: str(v) for k, v in self.ports.items()}}

    def command(self, *args: str) -> list[str]:
        return ["docker-compose", "-p", self.project, "--env-file", str(self.env_file),
                "-f", str(REPO / "compose.yaml"), "-f", str(self.override), *args]

    def popen(self, *args: str) -> subprocess.Popen:
        """docker-compose in the background (its output merged, as text)."""
        return subprocess.Popen(self.command(*args), cwd=REPO, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(*args), cwd=REPO, env=self.env(), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result

    def destroy(self) -> None:
        """`down -v`, then whatever a failed or interrupted `down` left (containers, volumes, network)."""
        self.compose("down", "-v", "-t", "1", check=False, timeout=300)
        label = f"label=com.docker.compose.project={self.project}"
        for container in self.podman("ps", "-aq", "--filter", label, check=False).stdout.split():
            self.podman("rm", "-f", "-t", "1", container, check=False)
        for volume in self.podman("volume", "ls", "-q", "--filter", label, check=False).stdout.split():
            self.podman("volume", "rm", "-f", volume, check=False)
        for network in ("default", "engines"):
            self.podman("network", "rm", "-f", f"{self.project}_{network}", check=False)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def logs(self, service: str, tail: int = 200) -> str:
        result = self.compose("logs", "--no-color", "--tail", str(tail), service, check=False, timeout=60)
        return result.stdout + result.stderr

    def init_process(self, service: str = "appliance-cpu") -> psutil.Process:
        """The container's PID 1, seen from the host."""
        pid = self.podman("inspect", "--format", "{{.State.Pid}}", self.container(service)).stdout.strip()
        return psutil.Process(int(pid))

    def processes(self, service: str = "appliance-cpu") -> list[psutil.Process]:
        init = self.init_process(service)
        return [init, *init.children(recursive=True)]

    def zombies(self, service: str = "appliance-cpu") -> list[str]:
        found = []
        for proc in self.processes(service):
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    found.append(f"{proc.pid} {proc.name()} (parent {proc.ppid()})")
            except psutil.NoSuchProcess:
                continue
        return found

    def vllm_server(self) -> psutil.Process:
        for proc in self.processes():
            try:
                cmdline = " ".join(proc.cmdline())
                if "vllm.entrypoints.openai.api_server" in cmdline and "appliance.engine.launch" not in cmdline:
                    return proc  # the server itself, not the launcher whose command line names it
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        raise LookupError("no vLLM server in the appliance container")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.gateway}/health/ready", timeout=3).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway was not ready within {timeout:.0f}s:\n{self.logs('appliance-cpu')}")
            time.sleep(2)
