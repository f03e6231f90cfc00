"""What code inside a real engine can get at: vLLM, its plugins and a model's code run in the engine's processes,
so whatever those processes can read, a hostile plugin or model file can. One appliance of its own (1 replica),
with every secret from a file (0600, the appliance's) and ``engine.user`` (nobody, which needs root to switch to):
checked from outside, on the running processes and by trying as the engine's own user, uid and group, what it
could read, and then the admin API with everything it did find.

This is the outside form of the check, not a hostile plugin loaded into the engine: the engines' credentials
(uid, groups, capabilities, environment) are read from /proc, and every read a plugin would try is tried by a
process holding exactly those credentials (``EngineUser.readable``), which the kernel answers the same way."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from appliance.engine.identity import EngineUser
from tests.integration.harness import ApplianceProcess

pytestmark = pytest.mark.engine

ENGINE_USER = "nobody"
SECRETS = {"admin-token": "iso-admin-s3cret", "api-keys": "iso-client-s3cret", "metrics-token": "iso-metrics-s3cret",
           "alerts-token": "iso-alerts-s3cret", "lease-token": "iso-lease-s3cret", "engine-key": "iso-engine-s3cret"}
SETTINGS = {"admin-token": "APPLIANCE_ADMIN_TOKEN_FILE", "api-keys": "APPLIANCE_API_KEYS_FILE",
            "metrics-token": "APPLIANCE_METRICS_TOKEN_FILE", "alerts-token": "APPLIANCE_ALERTS_TOKEN_FILE",
            "lease-token": "APPLIANCE_GATEWAY__LEASE_TOKEN_FILE", "engine-key": "APPLIANCE_GATEWAY__ENGINE_KEY_FILE"}
# The caches vLLM, torch and Hugging Face write: nobody's home (/nonexistent) holds none of them.
CACHES = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TORCHINDUCTOR_CACHE_DIR",
          "TRITON_CACHE_DIR", "HF_HOME")


def _switchable(user: EngineUser, model: Path) -> bool:
    """Root, and the engine user can run this interpreter and read the model (as an operator's would)."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, timeout=300, cwd="/",
                              **user.popen_options())
    except OSError:
        return False
    return done.returncode == 0 and user.readable([model / "config.json"]) == [model / "config.json"]


def _status(pid: int) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":\t") for line in
                                                     Path(f"/proc/{pid}/status").read_text().splitlines())}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


@pytest.fixture(scope="module")
def isolated(demo_model_int8, tmp_path_factory):
    user = EngineUser.lookup(ENGINE_USER)
    if not _switchable(user, demo_model_int8):
        pytest.skip("needs root, and a 'nobody' that can run this interpreter and read the demo model")
    shared = Path(tempfile.mkdtemp(prefix="appliance-isolation-"))  # under /tmp: every user may search it
    shared.chmod(0o755)
    secrets = shared / "secrets"
    secrets.mkdir(mode=0o755)
    for name, value in SECRETS.items():
        (secrets / name).write_text(value + "\n")
        (secrets / name).chmod(0o600)  # the appliance's alone, as docs/security.md asks
    caches = shared / "caches"
    caches.mkdir()
    caches.chmod(0o1777)
    env = {**{variable: str(secrets / name) for name, variable in SETTINGS.items()},
           **{variable: str(caches / variable.lower()) for variable in CACHES},
           "APPLIANCE_ENGINE__USER": ENGINE_USER, "VLLM_NO_USAGE_STATS": "1",
           "APPLIANCE_ENGINE__START_TIMEOUT_SECONDS": "600"}
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("isolated"), replicas=1,
                           env=env)
    app.start()
    try:
        app.wait_ready(timeout=400)
        yield app, user, secrets
    finally:
        app.stop(signal.SIGTERM)
        shutil.rmtree(shared, ignore_errors=True)


def test_the_engines_run_as_their_own_user_with_no_group_and_no_capability(isolated):
    app, user, _ = isolated
    engines = app.engine_processes()
    assert len(engines) >= 3  # the launcher, vLLM's server, its engine core
    for process in engines:
        status = _status(process.pid)
        assert status["Uid"].split() == [str(user.uid)] * 4, process.cmdline()
        assert status["Gid"].split() == [str(user.gid)] * 4 and status["Groups"] == "", process.cmdline()
        assert all(int(status[c], 16) == 0 for c in ("CapEff", "CapPrm", "CapInh", "CapAmb")), process.cmdline()


def test_what_an_engine_holds_or_can_read_opens_nothing_of_the_appliance(isolated):
    """Everything a plugin could find: its environment (the engine key is its own: it opens the engines, which it
    already is), the secret files (the paths are no secret), the appliance's environment and memory. Then the
    admin API and the restart lease, tried with every value it found."""
    app, user, secrets = isolated
    engines = app.engine_processes()
    found: set[str] = set()
    for process in engines:
        environ = _environ(process.pid)
        leaked = [k for k, v in environ.items() if any(s in v for s in SECRETS.values() if s != SECRETS["engine-key"])
                  or str(secrets) in v]
        assert not leaked, (process.cmdline(), leaked)
        found |= {v for v in environ.values() if v and v.isascii() and v.isprintable()}  # what fits a header
    assert SECRETS["engine-key"] in found  # VLLM_API_KEY: what vLLM requires of its callers
    assert app.proc is not None
    appliance = Path(f"/proc/{app.proc.pid}")
    tried = [*(secrets / name for name in SECRETS), appliance / "environ", appliance / "mem", appliance / "cmdline"]
    readable = user.readable(tried)
    assert readable == [appliance / "cmdline"], readable  # the command line only, which is world-readable
    assert not [s for s in SECRETS.values() if s in (appliance / "cmdline").read_text()]
    for value in found:
        headers = {"authorization": f"Bearer {value}"}
        assert httpx.get(f"{app.url}/admin/status", headers=headers, timeout=10).status_code == 401
        lease = httpx.post(f"{app.url}/maintenance/lease", headers=headers, timeout=10,
                           json={"holder": "x", "ports": [1], "ttl_seconds": 1})
        assert lease.status_code == 401


def test_the_engine_answers_the_gateway_only(isolated):
    app, _, _ = isolated
    body = {"model": "demo", "prompt": "The class statement", "max_tokens": 4}
    engine = f"http://127.0.0.1:{app.engine_port(0)}"
    assert httpx.post(f"{engine}/v1/completions", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{engine}/invocations", json=body, timeout=30).status_code == 401
    assert httpx.get(f"{engine}/health", timeout=30).status_code == 200
    client = {"authorization": f"Bearer {SECRETS['api-keys']}"}
    through = httpx.post(f"{app.url}/v1/completions", json=body, headers=client, timeout=60)
    assert through.status_code == 200, through.text
