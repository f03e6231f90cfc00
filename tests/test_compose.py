"""compose.yaml: valid for a real docker-compose, and the production properties an SRE relies on."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from appliance.settings import FLAT_ALIASES, Settings
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_ENV = {"GRAFANA_ADMIN_PASSWORD": "pw", "APPLIANCE_SECRETS_DIR": "/srv/appliance-secrets"}
SECRET_SETTINGS = ("admin_token", "alerts_token", "metrics_token", "api_keys")


def _compose_config(env: dict[str, str], compose_file: Path = ROOT / "compose.yaml") -> subprocess.CompletedProcess:
    """`docker-compose config` with only ``env``: an empty --env-file, since docker-compose would otherwise read the
    developer's own (untracked) .env beside compose.yaml, and a secret there would hide a missing default."""
    compose = require_tool("docker-compose", "docker-compose")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "GRAFANA_", "COMPOSE_"))}
    with tempfile.TemporaryDirectory() as scratch:
        empty = Path(scratch) / "empty.env"
        empty.write_text("")
        return subprocess.run([compose, "--env-file", str(empty), "-f", str(compose_file), "config"],
                              capture_output=True, text=True, env={**clean, **env}, cwd=compose_file.parent)


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
    result = _compose_config({"APPLIANCE_SECRETS_DIR": "/srv/appliance-secrets"})
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr
    result = _compose_config({"GRAFANA_ADMIN_PASSWORD": "pw"})
    assert result.returncode != 0
    assert "set APPLIANCE_SECRETS_DIR" in result.stderr and "docs/compose.md" in result.stderr  # says how


def test_a_local_env_file_does_not_reach_the_compose_checks(tmp_path) -> None:
    """.env is the operator's own file (untracked, secrets in it): the checks must see compose.yaml's defaults."""
    (tmp_path / "compose.yaml").write_text((ROOT / "compose.yaml").read_text())
    (tmp_path / ".env").write_text("GRAFANA_ADMIN_PASSWORD=from-a-local-env\n")
    result = _compose_config({"APPLIANCE_SECRETS_DIR": "/srv/s"}, tmp_path / "compose.yaml")
    assert result.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_env_is_the_operators_file_and_env_example_the_committed_one() -> None:
    """Issue 19: .env was tracked and the docs append the admin token to it: `git commit -a` would leak it."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".gitignore must ignore .env"
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index", ".env.example"], cwd=ROOT).returncode == 1
    doc = (ROOT / "docs" / "compose.md").read_text()
    assert "cp .env.example .env" in doc


def test_gpu_appliance_reserves_nvidia_devices_and_cpu_profile_runs_the_cpu_build(services) -> None:
    gpu, cpu = services["appliance"], services["appliance-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert cpu["build"]["args"]["ENGINE_BUILD"] == "cpu" and cpu["environment"]["APPLIANCE_DEVICE"] == "cpu"
    # plain `docker compose up` after `cp .env.example .env`: GPU
    assert (ROOT / ".env.example").read_text().count("COMPOSE_PROFILES=gpu") == 1


def test_appliance_drains_before_docker_kills_it(services) -> None:
    drain = Settings().gateway.drain_timeout_seconds
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


def test_an_unset_model_is_not_passed_as_an_empty_string(services) -> None:
    """APPLIANCE_MODEL="" reads as model "." (no demo model, vLLM handed "."): unset must stay unset."""
    for name in ("appliance", "appliance-cpu"):
        assert services[name]["environment"]["APPLIANCE_MODEL"] is None  # pass-through: only when set
    model = "/var/lib/appliance/models/m"
    result = _compose_config({**REQUIRED_ENV, "APPLIANCE_MODEL": model})
    assert yaml.safe_load(result.stdout)["services"]["appliance"]["environment"]["APPLIANCE_MODEL"] == model


def test_vllm_gets_shared_memory_and_models_default_to_a_named_volume(services) -> None:
    for name in ("appliance", "appliance-cpu"):
        service = services[name]
        assert service["shm_size"] == "8gb"
        # A missing bind-mount folder is created owned by root; a fresh named volume takes the image's owner.
        assert ("appliance-models", "/var/lib/appliance/models", False) in _mounts(service)


def test_monitoring_is_published_on_loopback_and_prometheus_lifecycle_is_off(services) -> None:
    for name in ("prometheus", "alertmanager", "grafana"):
        for port in services[name]["ports"]:
            published = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}"
            assert published.startswith("127.0.0.1:"), (name, port)
    flags = services["prometheus"]["command"]
    assert "--web.enable-lifecycle" not in flags and "--no-web.enable-lifecycle" in flags


def test_the_image_installs_offline_from_the_wheelhouse_and_runs_under_an_init() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = re.findall(r"pip install[^\n]*", dockerfile)
    assert installs and all("--no-index" in line for line in installs), installs
    assert "ARG BASE_IMAGE=" in dockerfile
    assert 'ENTRYPOINT ["tini", "--", "appliance-entrypoint"]' in dockerfile
    assert "/wheelhouse/" in (ROOT / ".gitignore").read_text().split()
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert "wheelhouse" not in ignored  # the build needs it in its context


def test_the_documented_secret_setup_generates_real_values(tmp_path) -> None:
    """docs/compose.md's .env and secrets recipes, run: a quoted heredoc would write the literal
    `$(openssl rand ...)`; every secret file gets its own random value, in a folder only its owner can list (the
    `sudo` lines, which hand the files to root and the image's group, are left out here)."""
    doc = (ROOT / "docs" / "compose.md").read_text()
    recipe = re.search(r"```bash\ncp \.env\.example \.env\n(cat >> \.env <<.*?\nENV\n)", doc, re.S)
    assert recipe, "docs/compose.md lost its .env recipe"
    subprocess.run(["bash", "-euc", recipe.group(1)], cwd=tmp_path, check=True)
    values = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines())
    assert re.fullmatch(r"[0-9a-f]{32}", values["GRAFANA_ADMIN_PASSWORD"])
    assert values["APPLIANCE_SECRETS_DIR"] == "./secrets"
    secrets_recipe = re.search(r"```bash\n(install -d -m 0700 secrets\n.*?)```", doc, re.S)
    assert secrets_recipe, "docs/compose.md lost its secrets recipe"
    script = "\n".join(line for line in secrets_recipe.group(1).splitlines() if not line.startswith("sudo "))
    subprocess.run(["bash", "-euc", script], cwd=tmp_path, check=True)
    folder = tmp_path / "secrets"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    tokens = [(folder / name).read_text().strip() for name in ("admin-token", "alerts-token", "metrics-token")]
    assert all(re.fullmatch(r"[0-9a-f]{64}", token) for token in tokens) and len(set(tokens)) == 3
    keys = Settings(api_keys_file=folder / "api-keys").gateway.api_keys
    assert len(keys) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys[0]) and keys[0] not in tokens
    assert "sudo chown root:10001 secrets/*" in secrets_recipe.group(1)
    assert "sudo chmod 0440 secrets/*" in secrets_recipe.group(1)


def test_docs_name_one_compose_command() -> None:
    """`docker compose` (the plugin) throughout the operator docs, not a mix with v1's `docker-compose`."""
    docs = [ROOT / "README.md", ROOT / "docs" / "compose.md", *sorted((ROOT / "docs" / "runbooks").glob("*.md"))]
    offenders = [f"{path.name}: {line.strip()}" for path in docs for line in path.read_text().splitlines()
                 if re.search(r"`docker-compose (up|down|ps|logs|restart|stop|build|exec)\b", line)]
    assert offenders == []


def test_the_gateways_workers_default_to_one_process_and_dotenv_sets_them(services, monkeypatch) -> None:
    default = Settings().gateway.workers
    for name in ("appliance", "appliance-cpu"):
        assert services[name]["environment"]["APPLIANCE_GATEWAY__WORKERS"] == str(default) == "1"
    result = _compose_config({**REQUIRED_ENV, "APPLIANCE_GATEWAY__WORKERS": "4"})
    assert result.returncode == 0, result.stderr
    for name, service in yaml.safe_load(result.stdout)["services"].items():
        if name.startswith("appliance"):
            assert service["environment"]["APPLIANCE_GATEWAY__WORKERS"] == "4", name
    monkeypatch.setenv("APPLIANCE_GATEWAY__WORKERS", "4")
    assert Settings().gateway.workers == 4  # a name the appliance reads


def test_the_operator_env_file_reaches_the_appliance(tmp_path) -> None:
    """Issue 19: engine and model settings in the operator's env file (APPLIANCE_ENV_FILE) reach the container;
    compose.yaml's fixed list used to drop them (a real Llama served as `demo` with max_model_len 1024)."""
    env_file = tmp_path / "appliance.env"
    env_file.write_text("APPLIANCE_SERVED_MODEL_NAME=llama-3-8b\nAPPLIANCE_ENGINE__MAX_MODEL_LEN=8192\n"
                        "APPLIANCE_ENGINE__KV_CACHE_DTYPE=fp8\n")
    result = _compose_config({**REQUIRED_ENV, "APPLIANCE_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("appliance", "appliance-cpu"):
        env = services[name]["environment"]
        assert env["APPLIANCE_SERVED_MODEL_NAME"] == "llama-3-8b", name
        assert env["APPLIANCE_ENGINE__MAX_MODEL_LEN"] == "8192", name
        assert env["APPLIANCE_ENGINE__KV_CACHE_DTYPE"] == "fp8", name
        assert "GRAFANA_ADMIN_PASSWORD" not in env  # the env file is the appliance's, not compose's .env


def test_the_default_env_file_and_config_exist_and_set_nothing(services) -> None:
    """docker-compose 1.29 (and Compose before v2.24) cannot make an env_file optional: the default one is
    committed, and it and the default config file leave every setting at its default."""
    from appliance.settings import load_settings

    defaults = Settings().model_dump()
    for name in ("appliance", "appliance-cpu"):
        env = services[name]["environment"]
        # vLLM's settings are the operator's; the engines' user is the image's (like APPLIANCE_ENGINE_HOST).
        chosen = [key for key in env if key.startswith(("APPLIANCE_ENGINE__", "APPLIANCE_SERVED"))]
        assert chosen == ["APPLIANCE_ENGINE__USER"], chosen
    assert (ROOT / "deploy" / "compose" / "appliance.env").is_file()
    assert load_settings(ROOT / "deploy" / "compose" / "appliance.yaml").model_dump() == defaults


def test_the_config_folder_is_mounted_read_only_and_read_at_start(services, tmp_path) -> None:
    """`appliance reload` re-reads the --config file given at start: it must be a mounted file the operator edits.
    A folder is mounted, not the file: an editor that saves by rename would leave a file mount on the old copy."""
    for name in ("appliance", "appliance-cpu"):
        service = services[name]
        command = service["command"]
        config = command[command.index("--config") + 1]
        mounts = {target: (source, ro) for source, target, ro in _mounts(service)}
        folder, file = config.rsplit("/", 1)
        assert mounts[folder] == (str(ROOT / "deploy" / "compose"), True), mounts
        assert (ROOT / "deploy" / "compose" / file).is_file()
    result = _compose_config({**REQUIRED_ENV, "APPLIANCE_CONFIG_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    mounts = _mounts(yaml.safe_load(result.stdout)["services"]["appliance"])
    assert (str(tmp_path), "/etc/appliance", True) in mounts


SERVICES = ("appliance", "appliance-cpu", "monitoring-config", "prometheus", "alertmanager", "grafana")


#: Added back, each where a service provably needs it: CHOWN for monitoring-config (it hands the rendered files to
#: nobody, 0600); SETUID, SETGID and KILL for the appliance (it starts and stops its engines as their own user).
CAPABILITIES = {"monitoring-config": ["CHOWN"], "appliance": ["SETUID", "SETGID", "KILL"],
                "appliance-cpu": ["SETUID", "SETGID", "KILL"]}


def test_every_service_drops_capabilities_gains_no_privileges_and_has_a_read_only_root(services) -> None:
    """Issue 21."""
    for name in SERVICES:
        service = services[name]
        assert service["cap_drop"] == ["ALL"], name
        assert service["security_opt"] == ["no-new-privileges:true"], name
        assert service["read_only"] is True, name
        assert service.get("cap_add", []) == CAPABILITIES.get(name, []), name
    for name in ("appliance", "appliance-cpu"):  # torch's CPU compiler loads what it builds in /tmp: exec
        assert services[name]["tmpfs"] == ["/tmp:rw,exec,nosuid,nodev,mode=1777"]


def test_secrets_reach_each_service_as_files_only_the_ones_it_uses(services) -> None:
    """Issue 21: no secret in any service's environment (children and `docker inspect` would show it); each is a
    compose secret file read through its *_file setting; monitoring-config gets the two it renders, nothing else."""
    secret_env = {f"APPLIANCE_{name.upper()}" for name in SECRET_SETTINGS}
    wanted = {"appliance": set(SECRET_SETTINGS), "appliance-cpu": set(SECRET_SETTINGS),
              "monitoring-config": {"alerts_token", "metrics_token"}}
    for name in SERVICES:
        service = services[name]
        env = service.get("environment") or {}
        assert not secret_env & set(env), name
        mounted = {secret["source"] for secret in service.get("secrets", [])}
        assert mounted == wanted.get(name, set()), name
        for setting in mounted:
            assert env[f"APPLIANCE_{setting.upper()}_FILE"] == f"/run/secrets/{setting}", (name, setting)
            assert FLAT_ALIASES[f"{setting}_file"] == ("gateway", f"{setting}_file")  # a name the appliance reads
    for name in ("appliance", "appliance-cpu"):  # the secrets are root:10001 0440; the image's own gid is another
        assert services[name]["group_add"] == ["10001"] or services[name]["group_add"] == [10001], name
    assert "--shared" not in services["monitoring-config"]["entrypoint"]  # world-readable tokens, before
    entrypoint = services["monitoring-config"]["entrypoint"]
    assert entrypoint[entrypoint.index("--owner") + 1] == "65534:65534"  # the monitoring images' user, nobody


def test_the_gateway_is_published_on_loopback_unless_the_operator_opts_in(services) -> None:
    for name in ("appliance", "appliance-cpu"):
        assert services[name]["ports"][0].startswith("127.0.0.1:8000:8000"), services[name]["ports"]
        assert services[name]["environment"]["APPLIANCE_API_KEYS_FILE"]  # keys always: a wider bind has them too
    wide = _compose_config({**REQUIRED_ENV, "APPLIANCE_BIND_ADDRESS": "10.0.0.5"})
    assert wide.returncode == 0, wide.stderr
    assert yaml.safe_load(wide.stdout)["services"]["appliance"]["ports"][0].startswith("10.0.0.5:8000:")


def test_the_engines_are_reachable_only_on_an_internal_network_prometheus_shares(services) -> None:
    """Issue 21: engines used to listen on 0.0.0.0 on the shared network (Grafana and Alertmanager could reach them
    past keys and admission). Now they bind the appliance's alias on `engines`, which only Prometheus also joins."""
    config = yaml.safe_load(_compose_config(REQUIRED_ENV).stdout)
    assert config["networks"]["engines"]["internal"] is True
    members = {name for name, service in services.items() if "engines" in (service.get("networks") or {})}
    assert members == {"appliance", "appliance-cpu", "prometheus"}
    for name in ("appliance", "appliance-cpu"):
        env, networks = services[name]["environment"], services[name]["networks"]
        assert env["APPLIANCE_ENGINE_HOST"] in networks["engines"]["aliases"]
        assert env["APPLIANCE_ENGINE_HOST"] not in networks["default"]["aliases"]
        assert env["APPLIANCE_ENGINE_ADVERTISE_HOST"] == env["APPLIANCE_ENGINE_HOST"]  # what Prometheus resolves


def test_the_engines_run_as_their_own_user_in_none_of_the_secrets_groups(services) -> None:
    """vLLM, its plugins and the model's code hold no secret: the appliance container starts as root only for the
    entrypoint, which becomes the appliance user (10001) keeping just what runs the engines as appliance-engine
    (10002, a group of its own); the secrets are root:10001 0440, so the engines cannot open them."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--uid 10002 --user-group" in dockerfile and "appliance-engine" in dockerfile
    assert "COPY deploy/image/entrypoint /usr/local/bin/appliance-entrypoint" in dockerfile
    entrypoint = (ROOT / "deploy" / "image" / "entrypoint").read_text()
    assert "--reuid=appliance --regid=appliance" in entrypoint
    assert "caps=-all,+setuid,+setgid,+kill" in entrypoint and '--ambient-caps="$caps"' in entrypoint
    for name in ("appliance", "appliance-cpu"):
        service = services[name]
        assert service["user"] == "root", name
        assert service["environment"]["APPLIANCE_ENGINE__USER"] == "appliance-engine", name
        assert ("appliance-engine-home", "/var/lib/appliance-engine", False) in _mounts(service), name


def test_the_documented_precise_prefix_switch_reaches_the_appliance_and_subscribes_on_loopback(tmp_path,
                                                                                              monkeypatch) -> None:
    """docs/compose.md's precise prefix routing lines, as an operator's env file: they reach both appliance
    services, and with them the settings run the engines' KV events on the container's loopback and subscribe the
    gateway there (the engines listen on the `engines` network's address, the events stay on 127.0.0.1); the
    committed defaults stay approximate (docs/tuning.md)."""
    from appliance.composition.prefix_cache import event_endpoints
    from appliance.engine.kv_events import kv_events_config
    from appliance.settings import load_settings
    from tests.doubles import FakeReplica

    doc = (ROOT / "docs" / "compose.md").read_text()
    section = doc.split("### Precise prefix routing", 1)[1].split("\n#", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = dict(line.split("=", 1) for line in block.splitlines() if line.strip())
    assert set(lines) == {"APPLIANCE_ENGINE__KV_EVENTS", "APPLIANCE_ROUTING__PREFIX_CACHE__MODE"}
    env_file = tmp_path / "appliance.env"
    env_file.write_text(block)
    result = _compose_config({**REQUIRED_ENV, "APPLIANCE_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("appliance", "appliance-cpu"):
        env = services[name]["environment"]
        assert {key: env.get(key) for key in lines} == lines, name
        for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
            monkeypatch.delenv(key)
        for key in (*lines, "APPLIANCE_ENGINE_HOST"):
            monkeypatch.setenv(key, env[key])
        settings = load_settings(ROOT / "deploy" / "compose" / "appliance.yaml")
        assert settings.role == "all" and settings.routing.prefix_cache.mode == "precise-with-fallback"
        assert settings.routing.prefix_cache.tokenizer is None  # the served model's own (`model`)
        subscribe = event_endpoints(settings)
        assert subscribe is not None
        replica = subscribe(FakeReplica("replica-0", f"http://{env['APPLIANCE_ENGINE_HOST']}:8100"))
        assert replica is not None and replica.events == "tcp://127.0.0.1:9100"
        assert kv_events_config(8100, settings.engine)["endpoint"] == "tcp://[::ffff:127.0.0.1]:9100"
    for key in lines:
        monkeypatch.delenv(key)
    assert Settings().routing.prefix_cache.mode == "approximate" and Settings().engine.kv_events == "off"
