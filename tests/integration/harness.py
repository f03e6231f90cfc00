"""Run a real ``appliance serve`` (real vLLM engines) as a subprocess, the way an operator runs it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports above it, below the kernel's ephemeral range: a port
    chosen inside it can be taken by any outgoing connection (an engine's, a client's) between the check and the
    bind a minute later (a CI run: the multi-host gateway's port, "address already in use")."""
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randint(10000, low - count - 1) if low > 12000 else random.randint(20000, 60000)
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def is_engine_process(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
        return "vllm.entrypoints" in cmdline or "appliance.engine.launch" in cmdline or "EngineCore" in proc.name() \
            or "EngineCore" in cmdline
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


@dataclass
class ApplianceProcess:
    model: Path
    state_dir: Path
    replicas: int = 2
    env: dict[str, str] = field(default_factory=dict)
    command: str = "serve"  # or "up": serve plus local Prometheus and Alertmanager
    host: str = "127.0.0.1"  # where the gateway listens (set APPLIANCE_HOST in env to match)
    base_port: int | None = None  # engine_base_port; default a free range, the gateway port just above it
    cores: set[int] | None = None  # CPU affinity of the whole process tree (its engines plan on these cores)
    proc: subprocess.Popen | None = None
    port: int = 0
    engine_pids_seen: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ApplianceProcess:
        base = free_port_range(self.replicas + 1) if self.base_port is None else self.base_port
        self.port = base + self.replicas
        env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
        env.update({
            "APPLIANCE_MODEL": str(self.model),
            # The tests ask for model "demo"; unset, the served name would be the model's path, as in vLLM.
            "APPLIANCE_SERVED_MODEL_NAME": "demo",
            "APPLIANCE_REPLICAS": str(self.replicas),
            "APPLIANCE_PORT": str(self.port),
            "APPLIANCE_ENGINE_BASE_PORT": str(base),
            "APPLIANCE_STATE_DIR": str(self.state_dir),
            "APPLIANCE_ENGINE__MAX_MODEL_LEN": "1024",
            "APPLIANCE_ENGINE__MAX_NUM_SEQS": "32",
            "APPLIANCE_ENGINE__KV_CACHE_SPACE_GIB": "1",
            "APPLIANCE_ENGINE__SHUTDOWN_TIMEOUT_SECONDS": "5",
            "APPLIANCE_RESTART_BACKOFF_INITIAL_SECONDS": "0.5",
            "APPLIANCE_DRAIN_TIMEOUT_SECONDS": "60",
            # vLLM without torch.compile: an engine starts in about 23 s instead of 61 s on 2 cores (the compile
            # is 30-40 s of both cores per start), and serves the demo model as fast. The suite starts engines
            # dozens of times; tests/model/test_quantize.py keeps vLLM's default, compiled path covered.
            "APPLIANCE_ENGINE__EXTRA_ARGS": "--enforce-eager",
            **self.env,
        })
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = (self.state_dir / "appliance.log").open("ab")
        cores = self.cores
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", self.command], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        return self

    def ready_replicas(self) -> int:
        try:
            return httpx.get(f"{self.url}/health/ready", timeout=2).json().get("ready_replicas", 0)
        except (httpx.HTTPError, ValueError):
            return 0

    def wait_ready(self, replicas: int | None = None, timeout: float = 300) -> None:
        wanted = self.replicas if replicas is None else replicas
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"appliance exited:\n{self.log_tail()}"
            if self.ready_replicas() >= wanted:
                self.engine_pids_seen |= {p.pid for p in self.engine_processes()}
                return
            time.sleep(1)
        raise TimeoutError(f"{wanted} replicas not ready after {timeout}s:\n{self.log_tail()}")

    def engine_processes(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if is_engine_process(p)]

    def vllm_server_pid(self, replica_index: int) -> int:
        """The vLLM API server of one replica (the launcher's child)."""
        for proc in self.engine_processes():
            cmdline = proc.cmdline()
            if "vllm.entrypoints.openai.api_server" in cmdline and "appliance.engine.launch" not in cmdline:
                port = cmdline[cmdline.index("--port") + 1]
                if int(port) == self.engine_port(replica_index):
                    return proc.pid
        raise LookupError(f"no vLLM server for replica {replica_index}")

    def engine_core_processes(self, replica_index: int) -> list[psutil.Process]:
        """The processes that do one replica's model work (vLLM's EngineCore, the API server's children):
        pausing them stalls generation while the API server still answers and notices disconnects."""
        return psutil.Process(self.vllm_server_pid(replica_index)).children(recursive=True)

    def engine_port(self, replica_index: int) -> int:
        return self.port - self.replicas + replica_index

    def engine_environ(self, replica_index: int = 0) -> dict[str, str]:
        """The environment of one replica's vLLM server, as /proc shows it to its user (the appliance's, here)."""
        raw = Path(f"/proc/{self.vllm_server_pid(replica_index)}/environ").read_bytes()
        return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)

    def engine_key(self) -> str:
        """The key the engines require of every caller but /health and /metrics (VLLM_API_KEY): configured, or
        generated by the appliance for its run and kept in memory only, so read where the engines got it."""
        return self.engine_environ()["VLLM_API_KEY"]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    @staticmethod
    def stop_all(processes: Sequence[ApplianceProcess], timeout: float = 60) -> None:
        """Stop those of ``processes`` that were started, the last started first."""
        for process in reversed(processes):
            if process.proc is not None:
                process.stop(timeout=timeout)

    def monitoring_processes(self) -> list[psutil.Process]:
        """The local Prometheus and Alertmanager `appliance up` started."""
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if "prometheus" in c.name()]

    def leftover_engine_processes(self) -> list[int]:
        """Engine processes this appliance started that still exist (should be none after stop)."""
        alive = []
        for pid in self.engine_pids_seen:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and is_engine_process(proc):
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def log_tail(self, lines: int = 40) -> str:
        path = self.state_dir / "appliance.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@contextmanager
def serving(app: ApplianceProcess, timeout: float = 400,
            stop_signal: int = signal.SIGTERM) -> Iterator[ApplianceProcess]:
    """``app`` started and ready (all its replicas) for the ``with`` block, stopped with ``stop_signal`` after it,
    whatever happens in it: a fixture's ``with serving(app) as running: yield running``."""
    app.start()
    try:
        app.wait_ready(timeout=timeout)
        yield app
    finally:
        app.stop(stop_signal)


# The multi-host tests' shared world: the DNS name the gateways discover nodes by, their admin token, and the
# discovery interval of gateways and nodes.
NAME = "appliance-engines.appliance.test"
ADMIN_TOKEN = "multihost-admin"
INTERVAL = 1.0


def wait_until(predicate, timeout: float, step: float = 0.1) -> float:
    """Seconds until ``predicate()`` held; raises after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError("condition not met")
        time.sleep(step)
    return time.monotonic() - started
