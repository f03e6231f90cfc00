"""Issue 21: engines get an explicit, allow-listed environment, never the appliance's secrets.

The process check runs the real launcher (appliance.engine.launch) around the stand-in engine and reads the
engine's /proc/<pid>/environ, which is what any code running inside the engine could read."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import psutil
import pytest

from appliance.collectors import ENGINE_STATS_DIR_ENV, ENGINE_STATS_INTERVAL_ENV
from appliance.engine.contract import ReplicaState
from appliance.engine.environment import allowed, engine_base_env
from appliance.engine.launch import GRACE_ENV, PARENT_ENV
from appliance.engine.placement import Placement
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from appliance.secret_files import SECRET_PAIRS
from tests.engine.support import FAKE_ENGINE, free_port, run, wait_for

# Every secret the appliance reads, as a value and as a file's path (admin, alerts, metrics and lease tokens, API
# keys, the engine key as the appliance's own setting, tenants' keys, Grafana's token), in every spelling.
SECRET_ENV = {pair.env: f"s3cret-{pair.value}" for pair in SECRET_PAIRS} | {
    f"{pair.env}_FILE": f"/run/secrets/{pair.value}" for pair in SECRET_PAIRS} | {
    f"APPLIANCE_GATEWAY__{pair.value.upper()}": f"s3cret-gw-{pair.value}" for pair in SECRET_PAIRS} | {
    "APPLIANCE_TENANTS": '[{"name": "a", "api_keys": ["s3cret-tenant"]}]',
    "APPLIANCE_MAINTENANCE__GRAFANA_TOKEN_FILE": "/run/secrets/grafana",
    "APPLIANCE_MAINTENANCE__GRAFANA_TOKEN": "s3cret-grafana", "APPLIANCE_PORT": "8000",
    "APPLIANCE_SOMETHING_NEW": "s3cret-later", "AWS_SECRET_ACCESS_KEY": "s3cret-aws", "DATABASE_URL": "s3cret-db"}
NEEDED_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
              "TMPDIR": "/tmp", "LD_LIBRARY_PATH": "/opt/lib", "VLLM_CPU_KVCACHE_SPACE": "1",
              "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "all",
              "HF_HOME": "/models/hf", "HF_TOKEN": "hub-token", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti",
              "PYTHONPATH": "/opt/py", "TRANSFORMERS_OFFLINE": "1", GRACE_ENV: "5", PARENT_ENV: "1",
              ENGINE_STATS_DIR_ENV: "/var/stats", ENGINE_STATS_INTERVAL_ENV: "2"}


def test_the_allow_list_keeps_what_engines_read_and_drops_every_appliance_secret() -> None:
    kept = engine_base_env({**SECRET_ENV, **NEEDED_ENV})
    assert kept == NEEDED_ENV  # HF_TOKEN is the engine's own credential (gated downloads), not the appliance's


def test_no_appliance_variable_passes_except_the_launchers_and_the_engine_plugins() -> None:
    """Invariant over every setting name: no APPLIANCE_<setting> reaches an engine, whatever settings exist later."""
    from appliance.settings import Settings

    for name in Settings.model_fields:
        assert not allowed(f"APPLIANCE_{name.upper()}"), name
        assert not allowed(f"APPLIANCE_{name.upper()}__X"), name


def test_a_started_engine_holds_no_appliance_secret_in_its_environment(tmp_path: Path, monkeypatch) -> None:
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = free_port()
    command = [sys.executable, "-m", "appliance.engine.launch", "--", sys.executable, FAKE_ENGINE, str(port)]
    spec = ReplicaSpec(index=0, port=port, command=command,
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0", ENGINE_STATS_DIR_ENV: str(tmp_path),
                            "VLLM_API_KEY": "engine-k3y"},
                       placement=Placement("cpu", cores=(0,)), log_path=tmp_path / "engine-0.log",
                       start_timeout_seconds=60, stop_timeout_seconds=1.0)

    async def scenario(session: aiohttp.ClientSession) -> None:
        replica = SupervisedReplica(spec)
        replica.start(session)
        try:
            await wait_for(lambda: replica.status.state is ReplicaState.READY, timeout=60)
            launcher = psutil.Process(replica.status.pid)
            engine = launcher.children()[0]
            for process in (launcher, engine):
                environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
                env = dict(item.decode().split("=", 1) for item in environ if item)
                leaked = [k for k, v in env.items() if "s3cret" in v or "/run/secrets" in v or k in SECRET_ENV]
                assert not leaked, (process.cmdline(), leaked)
                assert env["VLLM_API_KEY"] == "engine-k3y"  # the one credential an engine holds: its own key
                assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env[ENGINE_STATS_DIR_ENV] == str(tmp_path)
                assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] and env[GRACE_ENV] == "1.0"
        finally:
            await replica.stop()

    run(scenario)


@pytest.mark.parametrize("name", ["PATH", "HOME", "LANG", "TMPDIR", "LD_LIBRARY_PATH"])
def test_the_basics_pass(name: str) -> None:
    assert allowed(name)
