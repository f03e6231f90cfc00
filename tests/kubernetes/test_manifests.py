"""deploy/kubernetes validated offline: kustomize renders every overlay, every object validates against the
Kubernetes schemas (kubernetes-validate) or, for the Prometheus Operator and KEDA objects, against models
generated from their CRDs (cloudcoil-models-*); the generated monitoring never drifts from alerts/ and
dashboards/; promtool checks and tests the rules as the PrometheusRule carries them."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from appliance.monitoring import kubernetes as k8s
from appliance.settings import Settings
from tests.kubernetes.manifests import DEPLOY, ROOT, kubectl, render, validate

OVERLAYS = ["overlays/gpu", "overlays/cpu-demo", "base", "monitoring", "autoscaling", "monitoring-egress"]

promtool = shutil.which("promtool")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {path: render(path) for path in OVERLAYS}


@needs_kubectl
@pytest.mark.parametrize("path", OVERLAYS)
def test_every_rendered_object_validates(rendered, path):
    objects = rendered[path]
    assert objects
    for obj in objects:
        validate(obj)


@needs_kubectl
def test_the_validators_can_fail(rendered):
    gpu = rendered["overlays/gpu"]
    deployment = copy.deepcopy(next(o for o in gpu if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(Exception, match="paht"):
        validate(deployment)
    for kind in ("PrometheusRule", "ScaledObject", "PodMonitor", "AlertmanagerConfig"):
        broken = copy.deepcopy(next(o for o in gpu if o["kind"] == kind))
        broken["spec"]["bogusField"] = 1
        with pytest.raises(ValueError, match="CRD"):
            validate(broken)


def test_generated_monitoring_matches_its_sources():
    assert k8s.stale(k8s.render(), DEPLOY) == [], "run `python -m appliance.monitoring.kubernetes --write`"


def test_check_mode_reports_drift(tmp_path, capsys):
    k8s.write(k8s.render(), tmp_path)
    assert k8s.run(check=True, out_dir=tmp_path) == 0
    (tmp_path / "monitoring" / "prometheusrule.yaml").write_text("stale\n")
    assert k8s.run(check=True, out_dir=tmp_path) == 1
    assert "prometheusrule.yaml (generated)" in capsys.readouterr().out


def test_rules_and_dashboards_are_carried_unchanged():
    rule = k8s.prometheus_rule(ROOT)
    groups = [g for name in ("recording.rules.yaml", "alerts.rules.yaml")
              for g in yaml.safe_load((ROOT / "alerts" / name).read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    maps = k8s.dashboard_configmaps(ROOT)
    assert {name for m in maps for name in m["data"]} == {p.name for p in (ROOT / "dashboards").glob("*.json")}
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)


def test_autoscaling_thresholds_come_from_alerts_config():
    config = yaml.safe_load((ROOT / "alerts" / "config.yaml").read_text())
    target = k8s.Target()
    triggers = {t["name"]: t for t in k8s.scaled_object(ROOT, target)["spec"]["triggers"]}
    queue = config["alerts"]["ApplianceQueueBacklog"]["threshold"] * target.headroom
    kv = config["alerts"]["ApplianceKVCacheNearFull"]["threshold"] * target.headroom
    assert float(triggers["queue"]["metadata"]["threshold"]) == pytest.approx(queue)
    assert float(triggers["kv-cache"]["metadata"]["threshold"]) == pytest.approx(kv)
    assert "job:appliance_request_ttft_slow:ratio_rate5m" in triggers["ttft-burn"]["metadata"]["query"]


@needs_kubectl
@pytest.mark.skipif(promtool is None, reason="promtool is not installed")
def test_promtool_checks_and_tests_the_rules_from_the_prometheus_rule(rendered, tmp_path):
    rule = next(o for o in rendered["overlays/gpu"] if o["kind"] == "PrometheusRule")
    extracted = tmp_path / "extracted.rules.yaml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    check = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "tests").mkdir()
    test_files = []
    for source in sorted((ROOT / "alerts" / "tests").glob("*.test.yaml")):
        test = yaml.safe_load(source.read_text())
        test["rule_files"] = ["../extracted.rules.yaml"]
        path = tmp_path / "tests" / source.name
        path.write_text(yaml.safe_dump(test, sort_keys=False))
        test_files.append(str(path))
    assert test_files
    result = subprocess.run([promtool, "test", "rules", *test_files], capture_output=True, text=True,
                            cwd=tmp_path / "tests")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _pod(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)["spec"]["template"]["spec"]


@needs_kubectl
@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/cpu-demo"])
def test_pods_drain_before_kill_and_run_locked_down(rendered, overlay):
    objects = rendered[overlay]
    drain = Settings().gateway.drain_timeout_seconds
    config = yaml.safe_load((DEPLOY / "base" / "appliance.yaml").read_text())
    drain = config.get("drain_timeout_seconds", drain)
    for kind in ("Deployment", "StatefulSet"):
        pod = _pod(objects, kind)
        container = pod["containers"][0]
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > drain + pre_stop
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        # Node pods: ready with a serving engine; gateways: their own readiness (test_least_privilege.py).
        assert container["readinessProbe"]["httpGet"]["path"] == {"StatefulSet": "/health/ready",
                                                                   "Deployment": "/health/serving"}[kind]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        env = {e["name"]: e for e in container["env"]}
        # Gateways hold the admin token; node pods none of the gateways' (test_least_privilege.py says what).
        token_file = env.get("APPLIANCE_ADMIN_TOKEN_FILE", {}).get("value")
        assert token_file == ("/run/secrets/appliance/admin-token" if kind == "Deployment" else None)
        assert "APPLIANCE_ADMIN_TOKEN" not in env
    assert not [o for o in objects if o["kind"] == "Secret"], "secrets are created by the operator, never committed"
    headless = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "appliance-engines")
    assert headless["spec"]["clusterIP"] == "None"
    assert config["discovery"]["name"] == headless["metadata"]["name"]


@needs_kubectl
def test_gpu_nodes_ask_for_gpus_and_only_gateways_reach_engines(rendered):
    objects = rendered["overlays/gpu"]
    node = _pod(objects, "StatefulSet")["containers"][0]
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(rendered["overlays/cpu-demo"])
    policy = next(o for o in objects
                  if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "appliance-node-ingress")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "node"
    sources = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    components = {p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                  for p in sources if "namespaceSelector" not in p}
    assert components == {"gateway"}  # besides Prometheus (its own namespace) no one else


def _dotted(mapping: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in mapping.items():
        keys |= _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def test_the_configmap_carries_the_model_keys_both_roles_must_agree_on(tmp_path, monkeypatch):
    """Issue 19: gateway pods do not mount the model, so they cannot derive the served name or max_model_len as
    node pods do: the shared ConfigMap sets both, and docs/kubernetes.md names every key it carries."""
    from appliance.settings import load_settings

    for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    path = DEPLOY / "base" / "appliance.yaml"
    config = yaml.safe_load(path.read_text())
    keys = _dotted(config)
    assert {"served_model_name", "engine.max_model_len"} <= keys
    settings = load_settings(path)
    assert settings.served_model_name == config["served_model_name"]
    assert settings.engine.max_model_len == config["engine"]["max_model_len"]
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    missing = [key for key in sorted(keys) if f"`{key}`" not in doc]
    assert not missing, f"docs/kubernetes.md does not name the ConfigMap's keys {missing}"
    assert "every key of configuration.md" not in doc


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def gateway_cpu_problems(objects: list[dict[str, Any]]) -> list[str]:
    """The gateway pod's CPU request against its processes: with N workers the gateway is N workers and the
    decider, each one event loop that may fill a core, so it requests N + 1 cores; one process needs no more than
    the base's request."""
    container = next(c for c in _pod(objects, "Deployment")["containers"] if c["name"] == "gateway")
    env = {e["name"]: e.get("value") for e in container["env"]}
    if "APPLIANCE_GATEWAY__WORKERS" not in env:
        return ["the gateway does not say its workers (APPLIANCE_GATEWAY__WORKERS)"]
    workers = int(env["APPLIANCE_GATEWAY__WORKERS"])
    cores = _cores(str(container["resources"]["requests"]["cpu"]))
    if workers > 1 and cores < workers + 1:
        return [f"{workers} workers and the decider on a request of {cores:g} cores"]
    return []


@needs_kubectl
@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/cpu-demo", "base"])
def test_the_gateways_cpu_request_covers_its_workers(rendered, overlay, monkeypatch):
    assert gateway_cpu_problems(rendered[overlay]) == []
    container = _pod(rendered[overlay], "Deployment")["containers"][0]
    workers = next(e["value"] for e in container["env"] if e["name"] == "APPLIANCE_GATEWAY__WORKERS")
    assert workers == "1"  # the demo's engines need the cores; more is the operator's choice (docs/kubernetes.md)
    monkeypatch.setenv("APPLIANCE_GATEWAY__WORKERS", "3")
    assert Settings().gateway.workers == 3  # a name the appliance reads


@needs_kubectl
def test_the_gateway_cpu_check_can_fail(rendered):
    objects = copy.deepcopy(rendered["overlays/gpu"])
    container = _pod(objects, "Deployment")["containers"][0]
    next(e for e in container["env"] if e["name"] == "APPLIANCE_GATEWAY__WORKERS")["value"] = "3"
    assert gateway_cpu_problems(objects) == ["3 workers and the decider on a request of 0.5 cores"]
    container["resources"]["requests"]["cpu"] = "4"
    assert gateway_cpu_problems(objects) == []
    container["env"] = [e for e in container["env"] if e["name"] != "APPLIANCE_GATEWAY__WORKERS"]
    assert gateway_cpu_problems(objects) == ["the gateway does not say its workers (APPLIANCE_GATEWAY__WORKERS)"]


@needs_kubectl
def test_the_documented_workers_patch_sets_the_workers_and_their_cores(tmp_path):
    """docs/kubernetes.md's patch, applied by an overlay of the operator's over cpu-demo: the env entry replaces
    the base's by its name (not a second one), and the request covers the workers."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    patch = re.search(r"```yaml\n# gateway-workers\.yaml[^\n]*\n(.*?)```", doc, re.S)
    assert patch, "docs/kubernetes.md lost its workers patch"
    (tmp_path / "gateway-workers.yaml").write_text(patch.group(1))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "overlays" / "cpu-demo", tmp_path)],
        "patches": [{"path": "gateway-workers.yaml"}]}))
    out = subprocess.run([kubectl, "kustomize", str(tmp_path)], check=True, capture_output=True, text=True)
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    container = _pod(objects, "Deployment")["containers"][0]
    assert [e["value"] for e in container["env"] if e["name"] == "APPLIANCE_GATEWAY__WORKERS"] == ["3"]
    assert gateway_cpu_problems(objects) == []
    assert container["resources"]["requests"]["memory"] == "512Mi"  # the rest of the request is kept
    for obj in objects:
        validate(obj)
