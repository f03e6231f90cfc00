"""scripts/setup and scripts/lib/pip-sources.sh: where the CPU torch comes from is detected, not assumed, and a
machine that cannot get it is told at once, naming PyTorch's CPU index (the fresh-machine path of `make up`)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = "http://127.0.0.1:9"  # discard port: connection refused at once


def _isolated_pip_env(**extra: str) -> dict[str, str]:
    """No host pip configuration (find-links, mirrors, constraints): what a fresh machine has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "APPLIANCE_", "PYTORCH_"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"{UNREACHABLE}/simple",
            "PYTORCH_CPU_INDEX": f"{UNREACHABLE}/whl/cpu", **extra}


def _resolve(env: dict[str, str]) -> subprocess.CompletedProcess:
    script = f'. scripts/lib/pip-sources.sh; resolve_pip_sources {sys.executable} && echo "SOURCE=$PIP_SOURCE"'
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _fake_torch_wheel(folder: Path, version: str) -> None:
    name = f"torch-{version}+cpu"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        info = f"{name}.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+cpu\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_no_source_of_the_cpu_torch_stops_at_once_naming_the_pytorch_index() -> None:
    result = _resolve(_isolated_pip_env())
    assert result.returncode == 1
    assert "torch==2.13.0+cpu" in result.stderr and f"{UNREACHABLE}/whl/cpu" in result.stderr
    assert "APPLIANCE_WHEELHOUSE" in result.stderr


def test_pip_configured_find_links_that_carry_it_are_used_as_they_are(tmp_path: Path) -> None:
    _fake_torch_wheel(tmp_path, "2.13.0")
    result = _resolve(_isolated_pip_env(PIP_FIND_LINKS=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "SOURCE=pip's configured sources" in result.stdout


def test_a_wheelhouse_means_no_index_and_an_incomplete_one_is_refused(tmp_path: Path) -> None:
    result = _resolve(_isolated_pip_env(APPLIANCE_WHEELHOUSE=str(tmp_path)))
    assert result.returncode == 1 and "not a complete wheelhouse" in result.stderr
    (tmp_path / ".complete").write_text("pip\n")
    result = _resolve(_isolated_pip_env(APPLIANCE_WHEELHOUSE=str(tmp_path)))
    assert result.returncode == 0 and "(--no-index)" in result.stdout


def test_setup_refuses_a_python_older_than_3_11_with_a_clear_message(tmp_path: Path) -> None:
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\nif [ "$1" = -V ]; then echo "Python 3.10.12"; exit 0; fi\nexit 1\n')
    fake.chmod(0o755)
    result = subprocess.run([str(ROOT / "scripts" / "setup")], env={**os.environ, "PYTHON": str(fake)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Python 3.10.12 is too old" in result.stderr and "3.11 or newer" in result.stderr


def test_setup_refuses_a_cpu_build_without_python_headers_before_installing(tmp_path: Path) -> None:
    """Found by tests/compose/test_fresh_clone.py: without Python.h every vLLM CPU engine start failed with torch's
    CppCompileError, after minutes of installing; setup now says so before it creates anything."""
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *Python.h*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    result = subprocess.run([str(ROOT / "scripts" / "setup")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": str(fake), "APPLIANCE_ENGINE_BUILD": "cpu"})
    assert result.returncode == 1
    assert "Python.h" in result.stderr and "apt-get install gcc g++ python3-dev" in result.stderr


def _tools_env(tmp_path: Path, have: list[str]) -> dict[str, str]:
    """A PATH holding only ``have`` (stubs), bash's helpers, and an apt-get/sudo that record what was asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ["id", "cat"]:
        (bin_dir / name).symlink_to(Path("/usr/bin") / name)
    for name in have:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    for name in ["apt-get", "systemctl", "sudo"]:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/asked\n')
        (bin_dir / name).chmod(0o755)
    helpers = tmp_path / "podman-helpers"  # podman's helpers (netavark, aardvark-dns): none unless a test adds them
    helpers.mkdir()
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "APPLIANCE_PODMAN_HELPERS": str(helpers)}


def test_make_up_installs_only_the_monitoring_tools(tmp_path):
    """An operator's `make up` gets Prometheus and Alertmanager, not the test harness (podman, debootstrap...)."""
    env = _tools_env(tmp_path, ["promtool", "amtool"])
    done = subprocess.run(["/bin/bash", "scripts/setup-tools", "--monitoring"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "asked").exists()  # nothing to install
    done = subprocess.run(["/bin/bash", "scripts/setup-tools"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    asked = (tmp_path / "asked").read_text()
    assert done.returncode == 0 and "podman" in asked and "debootstrap" in asked and "prometheus " not in asked
    up_recipe = (ROOT / "Makefile").read_text().split("\nup: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "scripts/setup-tools --monitoring" in up_recipe


def test_setup_tools_installs_the_network_backend_whose_dns_resolves_service_names(tmp_path):
    """Found on a machine that never had netavark: with podman, runc and iptables alone (apt without recommends),
    podman ran on CNI without DNS, Prometheus could not resolve `alertmanager` and the compose test failed. The
    script now installs netavark and aardvark-dns whenever they are missing, even with podman present."""
    tools = ["promtool", "amtool", "docker-compose", "podman", "runc", "iptables", "debootstrap", "redis-server",
             "pg_ctl"]
    env = _tools_env(tmp_path, tools)
    done = subprocess.run(["/bin/bash", "scripts/setup-tools"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    install = [line for line in (tmp_path / "asked").read_text().splitlines() if " install " in line]
    assert len(install) == 1 and install[0].split()[-2:] == ["netavark", "aardvark-dns"], install
    helpers = Path(env["APPLIANCE_PODMAN_HELPERS"])
    for helper in ("netavark", "aardvark-dns"):
        (helpers / helper).write_text("#!/bin/sh\nexit 0\n")
        (helpers / helper).chmod(0o755)
    (tmp_path / "asked").unlink()
    done = subprocess.run(["/bin/bash", "scripts/setup-tools"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not (tmp_path / "asked").exists()


def _wheelhouse_checkout(tmp_path: Path, version: str) -> tuple[Path, dict[str, str]]:
    """A copy of what scripts/build-wheelhouse reads, and a stub Python ``version`` whose `pip wheel` writes a
    wheel named after the extras it was asked for and logs its arguments: no index is ever asked."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "lib").mkdir(parents=True)
    for name in ["scripts/build-wheelhouse", "scripts/lib/pip-sources.sh", "pyproject.toml", "Dockerfile"]:
        (repo / name).write_bytes((ROOT / name).read_bytes())
    (repo / "scripts" / "build-wheelhouse").chmod(0o755)
    major, minor = version.split(".")
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/pip.log
case "$1 $2 $3" in
  "-c "*) echo "{major}.{minor}";;
  "-m pip wheel") shift 3; while [ "$1" != --wheel-dir ]; do shift; done
    extras=$(printf '%s\\n' "$@" | sed -n 's/^\\.\\[\\(.*\\)\\]$/\\1/p' | tr , _)
    touch "$2/fake_$extras-1.0-py3-none-any.whl"; [ -z "$STUB_TORCH" ] || touch "$2/$STUB_TORCH";;
  "-m pip --version") echo "pip 24.0";;
esac
""")
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "APPLIANCE_"))}
    return repo, {**env, "PYTHON": str(stub)}


def _build_wheelhouse(repo: Path, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(repo / "scripts" / "build-wheelhouse")], cwd=repo, env={**env, **extra},
                          capture_output=True, text=True, timeout=60)


def test_build_wheelhouse_builds_again_for_other_extras(tmp_path: Path) -> None:
    """Issue 19: after the default (cpu,test) run, the gpu run said 'up to date' and the GPU image had no vllm."""
    repo, env = _wheelhouse_checkout(tmp_path, "3.11")
    assert _build_wheelhouse(repo, env).returncode == 0
    again = _build_wheelhouse(repo, env)
    assert again.returncode == 0 and "up to date" in again.stdout  # same inputs: nothing to do
    gpu = _build_wheelhouse(repo, env, APPLIANCE_WHEELHOUSE_EXTRAS="gpu",
                            STUB_TORCH="torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert gpu.returncode == 0, gpu.stderr
    assert "fake_gpu-1.0-py3-none-any.whl" in (repo / "wheelhouse" / "INDEX").read_text()


def test_build_wheelhouse_builds_again_after_a_pyproject_edit(tmp_path: Path) -> None:
    """The stamp is pyproject.toml's content, not its mtime: a copy or checkout that keeps the time still counts."""
    repo, env = _wheelhouse_checkout(tmp_path, "3.11")
    assert _build_wheelhouse(repo, env).returncode == 0
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# edited\n")
    os.utime(repo / "pyproject.toml", (0, 0))  # older than the stamp: only its content says it changed
    assert "up to date" not in _build_wheelhouse(repo, env).stdout


def test_build_wheelhouse_refuses_a_python_other_than_the_images(tmp_path: Path) -> None:
    """Issue 19: Ubuntu 24.04's python3 built cp312 wheels for the 3.11 image (Dockerfile: python:3.11-slim)."""
    repo, env = _wheelhouse_checkout(tmp_path, "3.12")
    result = _build_wheelhouse(repo, env)
    assert result.returncode == 2
    assert "Python 3.12" in result.stderr and "Python 3.11" in result.stderr
    assert not (repo / "wheelhouse").exists()


def test_a_gpu_wheelhouse_without_torchs_cuda_build_is_refused(tmp_path: Path) -> None:
    """Found building the GPU wheelhouse on a CPU machine: pip's configured sources offered torch==2.13.0+cpu,
    which satisfies vllm's torch==2.13.0 pin, so the 'GPU' wheelhouse held vllm with CPU torch only (exit 0)."""
    repo, env = _wheelhouse_checkout(tmp_path, "3.11")
    cpu_torch = _build_wheelhouse(repo, env, APPLIANCE_WHEELHOUSE_EXTRAS="gpu",
                                  STUB_TORCH="torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert cpu_torch.returncode == 1 and "no CUDA build of torch" in cpu_torch.stderr
    assert not (repo / "wheelhouse" / ".complete").exists()  # not stamped: the next run tries again
    # Both builds in one wheelhouse (the CPU run's +cpu wheel stays): fine, the Dockerfile excludes +cpu for GPU.
    cuda_torch = _build_wheelhouse(repo, env, APPLIANCE_WHEELHOUSE_EXTRAS="gpu",
                                   STUB_TORCH="torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert cuda_torch.returncode == 0, cuda_torch.stderr


def test_the_gpu_image_excludes_torchs_cpu_build_and_checks_for_cuda() -> None:
    """One ./wheelhouse serves both images, and pip prefers torch==X+cpu over torch==X (a higher local version)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "torch!=" in dockerfile and "torch.version.cuda" in dockerfile
