"""A real container engine for the compose test: Debian's rootful podman behind its Docker-compatible API, which
docker-compose 1.29 drives as it would drive Docker (recipe: the project's shared notes on podman-compose).

What the harness adds to a plain ``podman system service``, each for a reason found on these machines:

- a private containers.conf: podman's default ulimits exceed root's hard limits here (no CAP_SYS_RESOURCE), and
  crun refuses the hybrid cgroup layout, runc does not;
- a health-check loop: podman 4.3 schedules health checks with systemd timers, and without systemd every
  container stays "starting", so ``depends_on: condition: service_healthy`` would wait forever;
- netavark as the network backend, named in that configuration and checked before anything starts: its
  aardvark-dns resolves one service's name from another (Prometheus scrapes ``appliance-cpu`` and alerts
  ``alertmanager``). Without it podman falls back to CNI, where names do not resolve, and podman also keeps CNI on a
  machine whose storage already holds images unless the configuration says otherwise;
- cleanup of what netavark changes on the host: it turns on ip_forward and leaves NETAVARK iptables chains.

Images are built once and reused: podman's storage persists on the machine, and each image carries a label with
the hash of its inputs, so a run rebuilds only what changed. What a rebuild leaves untagged is pruned afterwards
(Podman.prune_images), or the store grows by gigabytes with each change of the code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

INPUTS_LABEL = "appliance.test.inputs"
# The image IDs in `podman build` output: "--> Using cache <id>", "--> <short id>", and the final full ID alone.
BUILD_LAYER = re.compile(r"^(?:--> (?:Using cache )?)?([0-9a-f]{12}|[0-9a-f]{64})\s*$", re.MULTILINE)
BASE_IMAGE = "localhost/appliance-test/debian:bookworm"
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
"""
# Where Debian's podman looks for its network helpers (containers.conf's helper_binaries_dir).
PODMAN_HELPERS = Path(os.environ.get("APPLIANCE_PODMAN_HELPERS", "/usr/lib/podman"))


def _run(args: list[str], *, env: dict[str, str] | None = None, check: bool = True, timeout: float | None = None,
         **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])}... exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return result


def hard_limit(resource: int) -> int:
    import resource as rlimit

    return rlimit.getrlimit(resource)[1]


def containers_conf(path: Path) -> Path:
    """podman's configuration for this machine, within root's hard limits."""
    import resource

    nofile = min(hard_limit(resource.RLIMIT_NOFILE), 65536)
    nproc = hard_limit(resource.RLIMIT_NPROC)
    nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
    path.write_text(CONTAINERS_CONF.format(nofile=nofile, nproc=nproc))
    return path


def require_podman(test: str) -> None:
    """Skip ``test`` where podman cannot run; in CI (APPLIANCE_REQUIRE_TOOLS=1) fail instead, so that it never
    passes by not running."""
    import pytest

    reason = cannot_run_reason()
    if reason:
        if os.environ.get("APPLIANCE_REQUIRE_TOOLS") == "1":
            pytest.fail(f"the {test} cannot run: {reason}")
        pytest.skip(f"the {test} needs podman: {reason}")


def cannot_run_reason() -> str | None:
    """Why podman cannot run real containers here (None when it can): not root, or a tool missing."""
    for binary, package in (("podman", "podman"), ("runc", "runc"), ("docker-compose", "docker-compose"),
                            ("debootstrap", "debootstrap")):
        if not shutil.which(binary):
            return f"{binary} not found: apt-get install {package} (scripts/setup-tools installs it)"
    for helper in ("netavark", "aardvark-dns"):
        if not os.access(PODMAN_HELPERS / helper, os.X_OK):
            return (f"{PODMAN_HELPERS / helper} not found: podman would run on CNI, where one container cannot resolve "
                    f"another's service name: apt-get install netavark aardvark-dns (scripts/setup-tools does)")
    if os.geteuid() != 0:
        return "rootful podman needs root (the compose test runs as root, as CI does)"
    return None


def network_backend_problem(backend: str) -> str | None:
    """Why podman's network backend (``podman info``'s Host.NetworkBackend) cannot run the stack, or None."""
    if backend.strip() == "netavark":
        return None
    return (f"podman's network backend is {backend.strip() or 'unknown'!r}, not netavark: service names would not "
            f"resolve between containers (Prometheus -> alertmanager); apt-get install netavark aardvark-dns")


def inputs_hash(paths: Iterable[Path], extra: str = "") -> str:
    """Hash of files (and folders, recursively), for an image's cache key."""
    digest = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Podman:
    """podman with the harness' configuration; ``env`` also serves docker-compose (DOCKER_HOST)."""

    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    service: subprocess.Popen | None = None
    _stop_health: threading.Event = field(default_factory=threading.Event)
    _health_thread: threading.Thread | None = None
    _ip_forward: str | None = None
    _chains_before: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = containers_conf(self.workdir / "containers.conf")
        self.socket = self.workdir / "podman.sock"
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf), "DOCKER_HOST": f"unix://{self.socket}"}

    def __call__(self, *args: str, check: bool = True, timeout: float | None = 120) -> subprocess.CompletedProcess:
        return _run(["podman", *args], env=self.env, check=check, timeout=timeout)

    # -- the API service and what it changes on the host ------------------------------------------------------

    def check_network_backend(self) -> None:
        """Fail before any container starts when names would not resolve between them (see the module's text)."""
        info = self("info", "--format", "{{.Host.NetworkBackend}}", check=False, timeout=120)
        problem = network_backend_problem(info.stdout) if info.returncode == 0 else f"podman info failed: {info.stderr}"
        if problem:
            raise RuntimeError(problem)

    def start_service(self) -> None:
        self.check_network_backend()
        self._ip_forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        self._chains_before = netavark_chains()
        self.socket.unlink(missing_ok=True)
        log = (self.workdir / "podman-service.log").open("ab")
        self.service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                                        env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"podman system service did not start (see {self.workdir}/podman-service.log)")
            time.sleep(0.2)
        self._health_thread = threading.Thread(target=self._play_health_timer, daemon=True, name="podman-health")
        self._health_thread.start()

    def stop_service(self) -> None:
        """Stop what start_service started, by PID, and undo netavark's changes to the host."""
        self._stop_health.set()
        if self._health_thread is not None:
            self._health_thread.join(timeout=10)
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait(timeout=5)
        if self._ip_forward is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(self._ip_forward + "\n")
        remove_netavark_chains(keep=self._chains_before)

    def _play_health_timer(self) -> None:
        """Run due health checks every second: what systemd timers do for podman where systemd runs."""
        while not self._stop_health.wait(1.0):
            # A loaded machine can make podman slow: a late round is skipped, never fatal.
            with contextlib.suppress(subprocess.TimeoutExpired):
                listed = self("ps", "-q", "--filter", "health=starting", check=False, timeout=60).stdout.split()
                listed += self("ps", "-q", "--filter", "health=healthy", check=False, timeout=60).stdout.split()
                listed += self("ps", "-q", "--filter", "health=unhealthy", check=False, timeout=60).stdout.split()
                for container in listed:
                    self("healthcheck", "run", container, check=False, timeout=60)

    def run_container(self, image: str, *command: str, name: str, volumes: dict[Path, str] | None = None,
                      network: str = "none", workdir: str | None = None, shm_size: str | None = None,
                      detach: bool = False, timeout: float | None = 120) -> subprocess.CompletedProcess:
        """``podman run`` of one container outside compose (``--network none`` unless told): the caller removes
        it by ``name`` (``podman rm -f``); without ``detach`` this waits for it, and its output is the result's."""
        args = ["run", "--name", name, "--network", network]
        for source, target in (volumes or {}).items():
            args += ["-v", f"{source}:{target}"]
        if workdir is not None:
            args += ["-w", workdir]
        if shm_size is not None:
            args += ["--shm-size", shm_size]
        if detach:
            args.append("-d")
        return self(*args, image, *command, check=False, timeout=timeout)

    def running(self, name: str) -> bool:
        result = self("inspect", "--format", "{{.State.Running}}", name, check=False, timeout=60)
        return result.stdout.strip() == "true"

    # -- images -------------------------------------------------------------------------------------------------

    def image_inputs(self, tag: str) -> str | None:
        result = self("image", "inspect", "--format", f'{{{{index .Labels "{INPUTS_LABEL}"}}}}', tag, check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def build(self, tag: str, context: Path, key: str, *, dockerfile: Path | None = None, target: str | None = None,
              args: dict[str, str] | None = None, timeout: float = 3600) -> bool:
        """Build ``tag`` unless an image with the same inputs exists; True when it built."""
        if self.image_inputs(tag) == key:
            return False
        command = ["build", "--layers", "-t", tag, "--label", f"{INPUTS_LABEL}={key}"]
        if dockerfile is not None:
            command += ["-f", str(dockerfile)]
        if target is not None:
            command += ["--target", target]
        for name, value in (args or {}).items():
            command += ["--build-arg", f"{name}={value}"]
        log = self.workdir / f"build-{re.sub(r'[^a-z0-9]+', '-', tag)}.log"
        with log.open("w") as out:
            result = subprocess.run(["podman", *command, str(context)], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"podman build {tag} failed: {log.read_text()[-4000:]}")
        self.remember_layers(tag, log.read_text())
        return True

    def remember_layers(self, tag: str, build_output: str) -> None:
        """Record the images ``tag``'s latest build made or reused, which prune_images keeps."""
        used = sorted(set(BUILD_LAYER.findall(build_output)))
        (self.workdir / f"layers-{re.sub(r'[^a-z0-9]+', '-', tag)}.ids").write_text("\n".join(used) + "\n")

    def prune_images(self) -> int:
        """Remove the untagged images that no tag's latest build used; the number removed.

        Every build that changes inputs leaves the previous image of its tag, and the stages it built, untagged:
        about 9 GB for appliance:cpu. Left there, they filled a CI machine's disk within a day of builds ("no space
        left on device" in COPY --from=engine-venv). The layers a tag's latest build used (its log's ``-->`` lines,
        kept in layers-<tag>.ids) stay, so an unchanged engine stage is still a cache hit; the rest goes, in passes,
        since removing an image can leave its parent untagged and childless."""
        keep = set()
        for ids in self.workdir.glob("layers-*.ids"):
            keep.update(ids.read_text().split())
        removed = 0
        for _ in range(20):
            listed = self("images", "-q", "--no-trunc", "--filter", "dangling=true", check=False, timeout=300)
            doomed = [image.removeprefix("sha256:") for image in dict.fromkeys(listed.stdout.split())]
            doomed = [image for image in doomed if not any(image.startswith(k) for k in keep)]
            if not doomed:
                break
            self("rmi", *doomed, check=False, timeout=1800)
            removed += len(doomed)
        return removed

    def ensure_base_image(self, cache: Path) -> bool:
        """A minimal Debian bookworm image from debootstrap (no registry here); True when it built one."""
        if self.image_inputs(BASE_IMAGE) == "debootstrap-bookworm":
            return False
        rootfs = cache / "rootfs"
        if rootfs.exists():
            shutil.rmtree(rootfs)
        _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()], timeout=1800)
        for source in ("/etc/apt/sources.list", "/etc/apt/sources.list.d", "/etc/apt/apt.conf.d"):
            if Path(source).exists():
                _run(["cp", "-a", source, str(rootfs / Path(source).parent.relative_to("/"))])
        for folder in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for item in (rootfs / folder).glob("*"):
                if item.is_file():
                    item.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run(["podman", "import", "--change", f"LABEL {INPUTS_LABEL}=debootstrap-bookworm", "-", BASE_IMAGE],
             env=self.env, stdin=tar.stdout, timeout=600)
        tar.wait()
        shutil.rmtree(rootfs)
        return True


def debian_mirror() -> str:
    """The Debian mirror apt already uses on this host (deb822 or one-line sources)."""
    texts = [p.read_text() for p in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
             if p.is_file()]
    for text in texts:
        for match in re.finditer(r"(?:URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+/debian)/?\s", text, re.M):
            return match.group(1)
    return "http://deb.debian.org/debian"


def netavark_chains() -> set[tuple[str, str]]:
    """(table, chain) of every NETAVARK chain in iptables now."""
    if not shutil.which("iptables"):
        return set()
    found = set()
    for table in ("filter", "nat"):
        listing = _run(["iptables", "-t", table, "-S"], check=False).stdout
        found |= {(table, chain) for chain in re.findall(r"^-N (NETAVARK\S*)", listing, re.M)}
    return found


def remove_netavark_chains(keep: set[tuple[str, str]] = frozenset()) -> None:
    """Flush and delete the NETAVARK chains netavark left in iptables, except those that were there before (the
    machine is shared: another user's containers may need them)."""
    if not shutil.which("iptables"):
        return
    for table in ("filter", "nat"):
        listing = _run(["iptables", "-t", table, "-S"], check=False).stdout
        chains = [c for c in re.findall(r"^-N (NETAVARK\S*)", listing, re.M) if (table, c) not in keep]
        for rule in re.findall(r"^-A (\S+) (.*-j NETAVARK\S*)$", listing, re.M):
            if not rule[0].startswith("NETAVARK") and any(rule[1].endswith(f"-j {c}") for c in chains):
                _run(["iptables", "-t", table, "-D", rule[0], *shlex.split(rule[1])], check=False)
        for chain in chains:
            _run(["iptables", "-t", table, "-F", chain], check=False)
        for chain in chains:
            _run(["iptables", "-t", table, "-X", chain], check=False)


@contextlib.contextmanager
def podman_service(workdir: Path) -> Iterator[Podman]:
    podman = Podman(workdir)
    podman.start_service()
    try:
        yield podman
    finally:
        podman.stop_service()
