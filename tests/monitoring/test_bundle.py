"""The monitoring bundle: one renderer for `appliance up` and compose; whole files, private secrets."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
import yaml

from appliance.composition.monitoring import assets_dir, write_bundle
from appliance.settings import ConfigError, Settings


def _receivers(bundle) -> dict[str, dict]:
    return {r["name"]: r for r in yaml.safe_load(bundle.alertmanager_config.read_text())["receivers"]}


def test_writes_configs_and_rules(tmp_path) -> None:
    bundle = write_bundle(tmp_path, Settings(admin_token="s3cret"), gateway="127.0.0.1:8000",
                          alertmanager="127.0.0.1:9093", prometheus="127.0.0.1:9090", env={})
    assert sorted(p.name for p in bundle.rules_dir.iterdir()) == ["alerts.rules.yaml", "recording.rules.yaml"]
    assert (bundle.rules_dir / "alerts.rules.yaml").read_text() == \
        (assets_dir(Settings()) / "alerts" / "alerts.rules.yaml").read_text()
    # The appliance's own receiver posts to the gateway's webhook with the admin token.
    webhook = _receivers(bundle)["appliance"]["webhook_configs"][0]
    assert webhook["url"] == "http://127.0.0.1:8000/admin/alerts"
    assert "s3cret" in bundle.alertmanager_config.read_text()
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind


def test_alertmanager_config_holding_the_token_is_private_unless_shared(tmp_path) -> None:
    settings = Settings(admin_token="s3cret")
    private = write_bundle(tmp_path / "local", settings, gateway="g:1", alertmanager=None, prometheus="p:2", env={})
    shared = write_bundle(tmp_path / "compose", settings, gateway="g:1", alertmanager=None, prometheus="p:2", env={},
                          shared=True)
    assert stat.S_IMODE(private.alertmanager_config.stat().st_mode) == 0o600
    assert stat.S_IMODE(shared.alertmanager_config.stat().st_mode) == 0o644


def test_webhook_urls_come_from_the_environment(tmp_path) -> None:
    env = {"APPLIANCE_PAGER_WEBHOOK_URL": "https://pager.example/hook"}
    bundle = write_bundle(tmp_path, Settings(admin_token="t"), gateway="g:1", alertmanager=None, prometheus="p:2",
                          env=env)
    receivers = _receivers(bundle)
    assert receivers["pager"]["webhook_configs"][0]["url"] == "https://pager.example/hook"
    assert not receivers["ticket"].get("webhook_configs")  # unset: a null receiver, still a valid config


def test_an_assets_dir_without_alerts_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="assets_dir"):
        write_bundle(tmp_path / "out", Settings(monitoring={"assets_dir": tmp_path}), gateway="g:1",
                     alertmanager=None, prometheus="p:2", env={})


def test_monitoring_config_needs_only_the_config_images_packages(tmp_path) -> None:
    """compose's init container has pydantic-settings, PyYAML, httpx and prometheus-client, not the engine stack:
    the command must not import vLLM, torch, FastAPI, aiohttp or matplotlib."""
    script = f"""
import sys
class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {{"vllm", "torch", "fastapi", "aiohttp", "matplotlib", "transformers", "uvicorn"}}:
            raise ImportError("the config image does not have " + name)
sys.meta_path.insert(0, Forbid())
from appliance.cli import main
sys.exit(main(["monitoring-config", "--out", {str(tmp_path)!r}, "--gateway", "appliance:8000"]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "prometheus.yml").is_file()


def _sd_authorization(bundle) -> dict | None:
    vllm = next(job for job in yaml.safe_load(bundle.prometheus_config.read_text())["scrape_configs"]
                if job["job_name"] == "vllm")
    return vllm["http_sd_configs"][0].get("authorization")


def test_engine_discovery_authenticates_when_api_keys_are_set(tmp_path) -> None:
    # /sd/targets needs a token when API keys are set: without it Prometheus would discover no engine.
    keyed = write_bundle(tmp_path / "keyed", Settings(admin_token="s3cret", api_keys=["k1"]), gateway="g:1",
                         alertmanager=None, prometheus="p:2", env={})
    assert _sd_authorization(keyed) == {"type": "Bearer", "credentials": "s3cret"}
    assert stat.S_IMODE(keyed.prometheus_config.stat().st_mode) == 0o600  # it holds a secret now
    no_admin = write_bundle(tmp_path / "no-admin", Settings(api_keys=["k1"]), gateway="g:1", alertmanager=None,
                            prometheus="p:2", env={})
    assert _sd_authorization(no_admin) == {"type": "Bearer", "credentials": "k1"}
    shared = write_bundle(tmp_path / "compose", Settings(admin_token="s3cret", api_keys=["k1"]), gateway="g:1",
                          alertmanager=None, prometheus="p:2", env={}, shared=True)
    assert stat.S_IMODE(shared.prometheus_config.stat().st_mode) == 0o644  # containers run as other users
    open_gateway = write_bundle(tmp_path / "open", Settings(admin_token="s3cret"), gateway="g:1", alertmanager=None,
                                prometheus="p:2", env={})
    assert _sd_authorization(open_gateway) is None and "s3cret" not in open_gateway.prometheus_config.read_text()
    assert stat.S_IMODE(open_gateway.prometheus_config.stat().st_mode) == 0o644
    assert not list(tmp_path.rglob(".*"))


def test_runbook_links_point_at_the_configured_public_url(tmp_path) -> None:
    """Issue 19: every alert's runbook_url is the appliance's own /runbooks/ALERT; a site whose on-call reaches
    the gateway at another URL sets monitoring.public_url and the bundle's rules say that URL."""
    settings = Settings(monitoring={"public_url": "https://llm.example/appliance/"})
    bundle = write_bundle(tmp_path, settings, gateway="appliance:8000", alertmanager=None,
                          prometheus="localhost:9090", env={})
    groups = yaml.safe_load((bundle.rules_dir / "alerts.rules.yaml").read_text())["groups"]
    urls = {rule["alert"]: rule["annotations"]["runbook_url"] for group in groups for rule in group["rules"]}
    assert urls and all(url == f"https://llm.example/appliance/runbooks/{name}" for name, url in urls.items()), urls
    source = yaml.safe_load((assets_dir(settings) / "alerts" / "alerts.rules.yaml").read_text())["groups"]
    for group in source:  # nothing else changed
        for rule in group["rules"]:
            rule["annotations"]["runbook_url"] = urls[rule["alert"]]
    assert groups == source


def _job(bundle, name: str) -> dict:
    return next(job for job in yaml.safe_load(bundle.prometheus_config.read_text())["scrape_configs"]
                if job["job_name"] == name)


def test_prometheus_uses_the_read_only_metrics_token_never_the_admin_token(tmp_path) -> None:
    """Issue 21: with a metrics token, Prometheus scrapes /metrics and /sd/targets with it, with or without API
    keys, and its configuration holds no admin token; the file is private (0600)."""
    for keys in ([], ["k1"]):
        settings = Settings(admin_token="adm-s3cret", metrics_token="met-t0ken", api_keys=keys)
        bundle = write_bundle(tmp_path / str(len(keys)), settings, gateway="g:1", alertmanager=None,
                              prometheus="p:2", env={})
        assert _sd_authorization(bundle) == {"type": "Bearer", "credentials": "met-t0ken"}
        assert _job(bundle, "appliance")["authorization"] == {"type": "Bearer", "credentials": "met-t0ken"}
        assert "adm-s3cret" not in bundle.prometheus_config.read_text() and "k1" not in \
            bundle.prometheus_config.read_text()
        assert stat.S_IMODE(bundle.prometheus_config.stat().st_mode) == 0o600
    plain = write_bundle(tmp_path / "plain", Settings(admin_token="adm-s3cret"), gateway="g:1", alertmanager=None,
                         prometheus="p:2", env={})
    assert "authorization" not in _job(plain, "appliance")  # no metrics token: /metrics stays open, as before


def test_with_api_keys_and_no_metrics_token_prometheus_scrapes_metrics_with_the_admin_token(tmp_path) -> None:
    """/metrics (tenant names, usage, quota levels) is closed once API keys are set: the local Prometheus
    (`appliance up`) must then send the admin token there, as it does to /sd/targets."""
    bundle = write_bundle(tmp_path / "keyed", Settings(admin_token="adm-s3cret", api_keys=["k1"]), gateway="g:1",
                          alertmanager=None, prometheus="p:2", env={})
    assert _job(bundle, "appliance")["authorization"] == {"type": "Bearer", "credentials": "adm-s3cret"}
    assert stat.S_IMODE(bundle.prometheus_config.stat().st_mode) == 0o600


def test_alertmanager_posts_with_the_alerts_token_when_set_else_the_admin_token(tmp_path) -> None:
    def credentials(bundle) -> str:
        return _receivers(bundle)["appliance"]["webhook_configs"][0]["http_config"]["authorization"]["credentials"]

    both = write_bundle(tmp_path / "both", Settings(admin_token="adm-s3cret", alerts_token="alr-t0ken"),
                        gateway="g:1", alertmanager=None, prometheus="p:2", env={"APPLIANCE_ADMIN_TOKEN": "env-adm"})
    assert credentials(both) == "alr-t0ken"
    assert "adm-s3cret" not in both.alertmanager_config.read_text() and "env-adm" not in \
        both.alertmanager_config.read_text()
    admin_only = write_bundle(tmp_path / "admin", Settings(admin_token="adm-s3cret"), gateway="g:1",
                              alertmanager=None, prometheus="p:2", env={})
    assert credentials(admin_only) == "adm-s3cret"
    nothing = write_bundle(tmp_path / "none", Settings(), gateway="g:1", alertmanager=None, prometheus="p:2",
                           env={"APPLIANCE_ALERTS_TOKEN": "stray"})
    assert not _receivers(nothing)["appliance"].get("webhook_configs")  # /admin/alerts would answer 403


def test_owner_hands_the_files_to_the_monitoring_user_and_keeps_secrets_private(tmp_path, monkeypatch) -> None:
    """compose: the init container (root) gives the bundle to Prometheus' and Alertmanager's user, 0600, instead
    of making the tokens world-readable (--shared)."""
    chowned: dict[str, tuple[int, int]] = {}
    monkeypatch.setattr("appliance.monitoring.bundle.os.chown", lambda path, uid, gid: chowned.update(
        {str(path): (uid, gid)}))
    settings = Settings(admin_token="adm", alerts_token="alr", metrics_token="met")
    bundle = write_bundle(tmp_path, settings, gateway="g:1", alertmanager="a:3", prometheus="p:2", env={},
                          owner=(65534, 65534))
    every = [*bundle.rules_dir.iterdir(), bundle.prometheus_config, bundle.alertmanager_config]
    assert {str(p) for p in every} == set(chowned) and set(chowned.values()) == {(65534, 65534)}
    for secret_file in (bundle.prometheus_config, bundle.alertmanager_config):
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


def test_monitoring_config_owner_takes_numbers_only(tmp_path, capsys) -> None:
    from appliance.cli import main

    with pytest.raises(SystemExit) as exit_code:
        main(["monitoring-config", "--out", str(tmp_path), "--owner", "nobody"])
    assert exit_code.value.code == 2 and "UID:GID" in capsys.readouterr().err
