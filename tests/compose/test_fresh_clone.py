"""`make up` on a fresh clone in a clean Debian container: the README's two claims about a fresh machine, run for
real.

The container is the compose test's debootstrap base plus only the packages of the README's apt line (read from
README.md, so the test fails when that line is not enough); the clone is `git clone --no-local` of HEAD, so no
host .venv, wheelhouse or var/ comes with it; podman passes no host environment, so no pip configuration either.
Both cases run with ``--network none``: no index, no mirror, no PyTorch CPU index is reachable.

- with a wheelhouse (``APPLIANCE_WHEELHOUSE=/wheelhouse make up``) it installs, builds the demo model and serves:
  the gateway answers an OpenAI completion, asked from inside the container;
- with nothing that carries the +cpu torch, `make up` stops at once with an error that names PyTorch's CPU index.

Timings (install, demo model, first ready; the failure's) go to the output and to
var/test-cache/compose/fresh-timings.txt. Wheelhouse: APPLIANCE_TEST_WHEELHOUSE=DIR (a complete one, from
scripts/build-wheelhouse), else REPO/wheelhouse, built as the compose stack test builds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.compose.podman import BASE_IMAGE, Podman, inputs_hash, podman_service, require_podman
from tests.compose.stack import IMAGES, REPO, Timings, build_wheelhouse, cache_dir

pytestmark = pytest.mark.compose

IMAGE = "localhost/appliance-test/fresh-machine:bookworm"
PYTORCH_CPU_INDEX = "download.pytorch.org/whl/cpu"
# What the fresh-machine block of README.md tells a user to install.
README_APT = re.compile(r"^sudo apt-get install -y ((?:[a-z0-9][a-z0-9+.-]*[ \t]*)+)$", re.M)
# GET (no body) or POST (a JSON body) from inside the container, with the system python3 the README installs.
HTTP_PROBE = """\
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], (sys.argv[2].encode() if len(sys.argv) > 2 else None)
request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=60) as response:
        print(json.dumps({"status": response.status, "body": response.read().decode()}))
except urllib.error.HTTPError as error:
    print(json.dumps({"status": error.code, "body": error.read().decode()}))
except OSError as error:
    print(json.dumps({"status": 0, "body": str(error)}))
"""
# Lines of `make up`'s output that end each phase.
INSTALLED, MODEL_STARTED, MODEL_BUILT = "setup: done", "appliance: building the demo model", "appliance: gateway "


def readme_packages() -> list[str]:
    match = README_APT.search((REPO / "README.md").read_text())
    assert match, "README.md has no `sudo apt-get install -y ...` line for a fresh machine"
    return match.group(1).split()


def engine_log_tail(clone: Path) -> str:
    logs = sorted((clone / "var" / "logs").glob("engine-*.log"))
    errors = [line for line in logs[0].read_text().splitlines() if "ERROR" in line] if logs else []
    return "the engine keeps failing to start:\n" + "\n".join(errors[-40:])


@dataclass
class FreshMachine:
    """The clean image, and fresh clones of HEAD to run `make up` in."""

    podman: Podman
    workdir: Path
    timings: Timings

    def clone(self, name: str) -> Path:
        target = self.workdir / name
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(["git", "clone", "--quiet", "--no-local", str(REPO), str(target)], check=True, timeout=300)
        return target

    @contextlib.contextmanager
    def container(self, clone: Path, *command: str, volumes: dict[Path, str] | None = None,
                  detach: bool = False, timeout: float = 120) -> Iterator[tuple[str, subprocess.CompletedProcess]]:
        """A container of the fresh image with ``clone`` at /src, removed (with the clone) afterwards."""
        name = f"appliance-fresh-{secrets.token_hex(3)}"
        try:
            # /dev/shm as a machine has it (podman's default is 64 MB; vLLM's CPU engine uses shared memory).
            result = self.podman.run_container(IMAGE, *command, name=name, workdir="/src", detach=detach,
                                               volumes={clone: "/src", **(volumes or {})}, shm_size="4g",
                                               timeout=timeout)
            yield name, result
        finally:
            self.podman("rm", "-f", "-t", "5", name, check=False)
            if (clone / "make-up.log").is_file():  # kept for a look after a failure: the clone goes
                shutil.copy(clone / "make-up.log", self.workdir.parent / f"fresh-{clone.name}-make-up.log")
            shutil.rmtree(clone, ignore_errors=True)

    def http(self, container: str, path: str, body: dict | None = None) -> tuple[int, str]:
        args = [json.dumps(body)] if body is not None else []
        result = self.podman("exec", container, "python3", "-c", HTTP_PROBE, f"http://127.0.0.1:8000{path}", *args,
                             check=False, timeout=120)
        if result.returncode != 0:
            return 0, result.stderr
        reply = json.loads(result.stdout.strip().splitlines()[-1])
        return reply["status"], reply["body"]


def wheelhouse() -> Path:
    given = os.environ.get("APPLIANCE_TEST_WHEELHOUSE")
    if not given:
        return build_wheelhouse()
    path = Path(given).resolve()
    assert (path / ".complete").is_file(), f"APPLIANCE_TEST_WHEELHOUSE={given} is not a complete wheelhouse"
    return path


@pytest.fixture(scope="module")
def fresh() -> Iterator[FreshMachine]:
    require_podman("fresh-clone test")
    cache = cache_dir()
    timings = Timings()
    # The service is not needed by `podman run`; its context undoes what the image build's network changes.
    with podman_service(cache / "podman") as podman:
        started = time.monotonic()
        podman.ensure_base_image(cache)
        packages = " ".join(readme_packages())
        dockerfile = IMAGES / "fresh-machine.Dockerfile"
        podman.build(IMAGE, IMAGES, inputs_hash([dockerfile], extra=BASE_IMAGE + packages), dockerfile=dockerfile,
                     args={"BASE_IMAGE": BASE_IMAGE, "PACKAGES": packages}, timeout=1800)
        podman.prune_images()
        timings.record(f"fresh-machine image ({packages})", started)
        machine = FreshMachine(podman, cache / "fresh", timings)
        try:
            yield machine
        finally:
            shutil.rmtree(machine.workdir, ignore_errors=True)
            (cache / "fresh-timings.txt").write_text("".join(f"{k}: {v}s\n" for k, v in timings.phases.items()))


def test_make_up_without_a_cpu_torch_source_stops_at_once_naming_the_index(fresh: FreshMachine) -> None:
    clone = fresh.clone("no-source")
    started = time.monotonic()
    # The timeout is the hang guard: "at once" means before pip starts downloading anything.
    with fresh.container(clone, "make", "up", timeout=300) as (_, result):
        fresh.timings.record("(b) no source: make up until it stopped", started)
        output = result.stdout + result.stderr
        print(f"\n(b) make up exited {result.returncode}:\n{output}", flush=True)
        assert result.returncode != 0, output
        assert PYTORCH_CPU_INDEX in output, output
        assert "APPLIANCE_WHEELHOUSE=DIR make up" in output, output  # and the offline way out
        assert "setup: installing" not in output, output  # it stopped before pip installed anything
        assert not list((clone / ".venv").glob(".installed-*")), output


def test_make_up_with_a_wheelhouse_installs_offline_and_serves(fresh: FreshMachine) -> None:
    clone = fresh.clone("wheelhouse")
    log = clone / "make-up.log"
    command = "APPLIANCE_WHEELHOUSE=/wheelhouse make up >make-up.log 2>&1"
    started = time.monotonic()
    with fresh.container(clone, "sh", "-c", command, volumes={wheelhouse(): "/wheelhouse:ro"}, detach=True) as (
            name, result):
        assert result.returncode == 0, result.stderr
        seen: dict[str, float] = {}
        deadline = started + 1800
        while True:
            text = log.read_text() if log.exists() else ""
            for marker in (INSTALLED, MODEL_STARTED, MODEL_BUILT):
                if marker in text and marker not in seen:
                    seen[marker] = time.monotonic()
            if MODEL_BUILT in seen and fresh.http(name, "/health/ready")[0] == 200:
                break
            assert fresh.podman.running(name), f"make up exited before the gateway was ready:\n{text[-6000:]}"
            # An engine that cannot start restarts forever: three exits are a verdict, with the engine's reason.
            assert text.count("engine exited with") < 3, engine_log_tail(clone)
            assert time.monotonic() < deadline, f"no ready gateway within 30 minutes:\n{text[-6000:]}"
            time.sleep(2)
        ready = time.monotonic()
        text = log.read_text()
        fresh.timings.phases["(a) wheelhouse: install (make up -> setup: done)"] = round(seen[INSTALLED] - started, 1)
        if MODEL_STARTED in seen:
            fresh.timings.phases["(a) wheelhouse: demo model build"] = round(seen[MODEL_BUILT] - seen[MODEL_STARTED], 1)
        fresh.timings.phases["(a) wheelhouse: engine start to ready"] = round(ready - seen[MODEL_BUILT], 1)
        fresh.timings.phases["(a) wheelhouse: make up to first ready"] = round(ready - started, 1)
        print("\n".join(f"fresh clone: {k} {v}s" for k, v in fresh.timings.phases.items()), flush=True)

        assert "from the wheelhouse /wheelhouse only (--no-index)" in text, text[-6000:]
        assert (clone / ".venv" / ".installed-cpu").is_file(), text[-6000:]
        status, body = fresh.http(name, "/v1/completions",
                                  {"model": "demo", "prompt": "A class is", "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        reply = json.loads(body)
        assert reply["object"] == "text_completion" and reply["model"] == "demo", reply
        assert isinstance(reply["choices"][0]["text"], str) and reply["usage"]["completion_tokens"] > 0, reply
