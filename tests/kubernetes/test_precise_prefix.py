"""Precise prefix routing on Kubernetes (components/precise-prefix, overlays/cpu-demo-precise), checked offline on
what `kubectl kustomize` renders: every object validates; each role's settings, loaded from the rendered ConfigMap
and the workload's environment as the pod would, turn the engines' events on (node pods) and subscribe to them
(gateways); every port a gateway will connect to is a declared port of the node pods, listed on the headless
Service and admitted by the NetworkPolicies, from the gateways and no one else; the gateways hash blocks with the
engines' seed and read the engines' own tokenizer. Like test_least_privilege.py, each check is a function with a
test that it flags a broken manifest."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from appliance.composition.prefix_cache import event_endpoints
from appliance.engine.kv_events import HASH_SEED, kv_events_config, kv_events_env
from appliance.settings import Settings, load_settings
from tests.doubles import FakeReplica
from tests.kubernetes.manifests import DEPLOY, ROOT, _Loader, kubectl, render, validate
from tests.kubernetes.test_least_privilege import (
    component,
    disk_problems,
    egress_allows,
    egress_problems,
    lockdown_problems,
    pod_of,
    policies,
    secret_problems,
    selects,
    workloads,
)

pytestmark = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed")

GPU = "overlays/gpu + components/precise-prefix"
CPU = "overlays/cpu-demo-precise"
GATEWAY = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "gateway"}
NODE = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "node"}
NEW_POLICIES = {"appliance-kv-events-ingress", "appliance-kv-events-egress"}


def _with_component(root: Path, overlay: str, name: str) -> list[dict[str, Any]]:
    """``overlay`` with ``components/name`` added, as an operator's own overlay would (kustomize takes relative
    paths only)."""
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / overlay, root)],
        "components": [os.path.relpath(DEPLOY / "components" / name, root)]}))
    out = subprocess.run([kubectl, "kustomize", str(root)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.load_all(out.stdout, Loader=_Loader) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    return {GPU: _with_component(tmp_path_factory.mktemp("precise"), "overlays/gpu", "precise-prefix"),
            CPU: render(CPU), "overlays/gpu": render("overlays/gpu")}


def _workload(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return next(w for w in workloads(objects) if component(w) == role)


def _container(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return pod_of(_workload(objects, role))["containers"][0]


def role_settings(objects: list[dict[str, Any]], role: str, scratch: Path) -> Settings:
    """The settings a ``role`` pod starts with: the rendered ConfigMap's file and the container's environment,
    each secret file it names replaced by a placeholder in ``scratch`` (the variables of this process set aside)."""
    container = _container(objects, role)
    configmap = next(o for o in objects if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].startswith("appliance-settings"))
    config = scratch / "appliance.yaml"
    config.write_text(configmap["data"]["appliance.yaml"])
    env = {}
    for var in container["env"]:
        name, value = var["name"], var.get("value", "")
        if not name.startswith("APPLIANCE_") or name in ("APPLIANCE_MODEL", "APPLIANCE_DEVICE"):
            continue  # the model and device are checked where they exist (a GPU node), not here
        if name.endswith("_FILE"):
            value = str(scratch / Path(value).name)
            Path(value).write_text("placeholder-secret\n")
        env[name] = value
    env["APPLIANCE_STATE_DIR"] = str(scratch / "state")
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("APPLIANCE_")]}
    os.environ.update(env)
    try:
        return load_settings(config)
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def ingress_allows(objects: list[dict[str, Any]], dest: dict[str, str], port: int | str,
                   source: dict[str, str]) -> bool:
    """Whether some Ingress policy selecting ``dest`` admits ``port`` from pods labelled ``source`` (same
    namespace)."""
    for policy in policies(objects, "Ingress", dest):
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in [p.get("port") for p in rule["ports"]]:
                continue
            for peer in rule.get("from", [{}]):
                if "namespaceSelector" not in peer and selects(peer.get("podSelector", {}), source):
                    return True
    return False


# -- the checks ------------------------------------------------------------------------------------------------

def event_port_problems(objects: list[dict[str, Any]], scratch: Path) -> list[str]:
    """Node pods publish where the gateways will subscribe: for each engine of a node (``engines_per_node``),
    its event and replay ports as the node's settings bind them are the ports the gateway's settings connect to,
    declared by name on the node container, listed on the headless Service the gateways resolve, allowed out of
    the gateway pods and into the node pods from the gateway pods."""
    problems = []
    gateway, node = role_settings(objects, "gateway", scratch), role_settings(objects, "node", scratch)
    if gateway.routing.prefix_cache.mode != "precise-with-fallback":
        problems.append(f"gateways route {gateway.routing.prefix_cache.mode}")
    if node.engine.kv_events != "network":
        problems.append(f"node engines publish {node.engine.kv_events!r}, not on the pod network")
    subscribe = event_endpoints(gateway)
    if subscribe is None:
        return [*problems, "gateways subscribe to no engine's events (discovery.kv_events)"]
    declared = {p["containerPort"]: p["name"] for p in _container(objects, "node")["ports"]}
    service = next(o for o in objects if o["kind"] == "Service"
                   and o["metadata"]["name"] == gateway.discovery.name)
    listed = {p["targetPort"] for p in service["spec"]["ports"]}
    if node.replicas != gateway.discovery.engines_per_node:
        problems.append(f"node pods run {node.replicas} engines, gateways expect {gateway.discovery.engines_per_node}")
    for i in range(gateway.discovery.engines_per_node):
        port = gateway.engine.base_port + i
        endpoints = subscribe(FakeReplica(f"engine-{i}", f"http://10.0.0.1:{port}"))
        assert endpoints is not None and endpoints.replay is not None
        config = kv_events_config(node.engine.base_port + i, node.engine)
        if config is None:
            problems.append(f"engine {i} publishes no events")
            continue
        bound = [urlsplit(str(config["endpoint"])).port, urlsplit(str(config["replay_endpoint"])).port]
        for address, binds in zip((endpoints.events, endpoints.replay), bound, strict=True):
            wanted = urlsplit(address).port
            name = declared.get(wanted)
            if wanted != binds:
                problems.append(f"gateways connect to {wanted}, engine {i} binds {binds}")
            if name is None:
                problems.append(f"port {wanted} is not a containerPort of the node pods")
                continue
            if name not in listed:
                problems.append(f"{name} is not on the headless Service {service['metadata']['name']}")
            if not egress_allows(objects, GATEWAY, name, NODE):
                problems.append(f"no egress from the gateways to the node pods' {name}")
            if not ingress_allows(objects, NODE, name, GATEWAY):
                problems.append(f"no ingress to the node pods' {name} from the gateways")
    return problems


def hashing_problems(objects: list[dict[str, Any]], scratch: Path) -> list[str]:
    """The gateways seed the first block hash as the engines are started with (PYTHONHASHSEED), and read the
    tokenizer the engines serve: the node pods' model, from the same claim, read-only; or, with no shared volume
    (cpu-demo), the demo model's, built by the gateway's init container into the folder it reads."""
    problems = []
    gateway, node = role_settings(objects, "gateway", scratch), role_settings(objects, "node", scratch)
    seed = kv_events_env(node.engine).get("PYTHONHASHSEED")
    if gateway.routing.prefix_cache.hash_seed != seed:
        problems.append(f"gateways seed {gateway.routing.prefix_cache.hash_seed!r}, engines {seed!r}")
    tokenizer = gateway.routing.prefix_cache.tokenizer
    if tokenizer is None:
        return [*problems, "no tokenizer for the gateways"]
    pod = pod_of(_workload(objects, "gateway"))
    mount = next((m for m in pod["containers"][0].get("volumeMounts", [])
                  if tokenizer.is_relative_to(m["mountPath"])), None)
    if mount is None:
        return [*problems, f"the tokenizer {tokenizer} is on no volume of the gateway container"]
    if mount.get("readOnly") is not True:
        problems.append(f"the gateways mount {mount['name']} writable")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    node_pod = pod_of(_workload(objects, "node"))
    node_env = {e["name"]: e.get("value") for e in node_pod["containers"][0]["env"]}
    if "persistentVolumeClaim" in volume:
        node_mounts = {m["name"]: m["mountPath"] for m in node_pod["containers"][0]["volumeMounts"]}
        same = [v for v in node_pod["volumes"] if v.get("persistentVolumeClaim") == volume["persistentVolumeClaim"]]
        if not same or volume["persistentVolumeClaim"].get("readOnly") is not True:
            problems.append("the gateways' model claim is not the node pods' own, read-only")
        elif node_mounts.get(same[0]["name"]) != mount["mountPath"] or node_env.get("APPLIANCE_MODEL") != str(
                tokenizer):
            problems.append(f"the gateways read {tokenizer}, the node pods serve {node_env.get('APPLIANCE_MODEL')}")
    else:
        builders = [c for c in pod.get("initContainers", [])
                    if c.get("args", [])[:2] == ["demo-model", str(tokenizer)]
                    and any(m["name"] == mount["name"] for m in c.get("volumeMounts", []))]
        if "APPLIANCE_MODEL" in node_env or not builders:
            problems.append(f"nothing puts the engines' tokenizer at {tokenizer}")
        elif builders[0]["image"] != pod["containers"][0]["image"]:
            problems.append("the tokenizer is built from another image than the gateway's")
    return problems


# -- the tests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [GPU, CPU])
def test_every_object_validates_and_stays_locked_down(rendered, variant):
    objects = rendered[variant]
    for obj in objects:
        validate(obj)
    assert disk_problems(objects) == [] and lockdown_problems(objects) == []
    assert secret_problems(objects) == [] and egress_problems(objects) == []
    namespaced = [o for o in objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"appliance"}


@pytest.mark.parametrize("variant", [GPU, CPU])
def test_every_port_the_gateways_subscribe_to_is_declared_and_admitted(rendered, variant, tmp_path):
    assert event_port_problems(rendered[variant], tmp_path) == []


@pytest.mark.parametrize("variant", [GPU, CPU])
def test_gateways_hash_and_tokenize_as_the_engines_do(rendered, variant, tmp_path):
    assert hashing_problems(rendered[variant], tmp_path) == []
    assert role_settings(rendered[variant], "gateway", tmp_path).routing.prefix_cache.hash_seed == HASH_SEED


def test_the_event_port_check_can_fail(rendered, tmp_path):
    objects = copy.deepcopy(rendered[GPU])
    egress = next(o for o in objects if o["metadata"]["name"] == "appliance-kv-events-egress")
    egress["spec"]["egress"][0]["ports"] = [{"port": "kv-events-0"}]
    node = _container(objects, "node")
    node["ports"] = [p for p in node["ports"] if p["name"] != "kv-events-0"]
    problems = event_port_problems(objects, tmp_path)
    assert "port 9100 is not a containerPort of the node pods" in problems
    assert "no egress from the gateways to the node pods' kv-replay-0" in problems
    node["env"] = [e for e in node["env"] if e["name"] != "APPLIANCE_ENGINE__KV_EVENTS"]
    assert "node engines publish 'off', not on the pod network" in event_port_problems(objects, tmp_path)
    assert event_port_problems(rendered["overlays/gpu"], tmp_path) == [
        "gateways route approximate", "node engines publish 'off', not on the pod network",
        "gateways subscribe to no engine's events (discovery.kv_events)"]


def test_the_hashing_check_can_fail(rendered, tmp_path):
    objects = copy.deepcopy(rendered[GPU])
    gateway = _container(objects, "gateway")
    gateway["env"].append({"name": "APPLIANCE_ROUTING__PREFIX_CACHE__HASH_SEED", "value": "0"})
    next(m for m in gateway["volumeMounts"] if m["name"] == "models")["readOnly"] = False
    problems = hashing_problems(objects, tmp_path)
    assert "gateways seed '0', engines 'random'" in problems
    assert "the gateways mount models writable" in problems
    cpu = copy.deepcopy(rendered[CPU])
    pod_of(_workload(cpu, "gateway"))["initContainers"][0]["image"] = "elsewhere/appliance:1"
    assert hashing_problems(cpu, tmp_path) == ["the tokenizer is built from another image than the gateway's"]


def test_the_demo_gateways_build_the_engines_tokenizer_and_route_precisely(rendered, tmp_path):
    """cpu-demo-precise: the gateway's init container, run as it is (its arguments, the model volume here), writes
    the tokenizer files the node pods' demo model carries (trained in another process: the build is
    deterministic), and the gateway's settings with them build precise routing that tokenizes a chat prompt."""
    from appliance.composition.prefix_cache import build_precise_routing
    from appliance.gateway.routing.kv_events.tokens import TokenJob
    from appliance.model.demo import _topic_split, _write_tokenizer, train_tokenizer

    objects = rendered[CPU]
    pod = pod_of(_workload(objects, "gateway"))
    init = pod["initContainers"][0]
    models = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "models")
    args = [arg.replace(models, str(tmp_path / "models")) for arg in init["args"]]
    subprocess.run([str(Path(sys.executable).parent / "appliance"), *args], check=True, capture_output=True,
                   cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    tokenizer = role_settings(objects, "gateway", tmp_path).routing.prefix_cache.tokenizer
    built = tmp_path / "models" / tokenizer.relative_to(models)
    engines = tmp_path / "engines"
    engines.mkdir()
    _write_tokenizer(train_tokenizer(_topic_split()[0]), engines)  # what build_demo_model writes on a node
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (built / name).read_bytes() == (engines / name).read_bytes(), name
    objects = copy.deepcopy(objects)  # the gateway as it starts, its volume where the test wrote it
    for var in _container(objects, "gateway")["env"]:
        if var["name"] == "APPLIANCE_ROUTING__PREFIX_CACHE__TOKENIZER":
            var["value"] = str(built)
    routing = build_precise_routing(role_settings(objects, "gateway", tmp_path), list)
    assert routing is not None and not routing.precise_only
    try:
        ids = routing.hook.tokenizer.tokenize(TokenJob(None, messages=[{"role": "user", "content": "Hello"}],
                                                       chat={"add_generation_prompt": True}))
        assert ids[0] == 1 and len(ids) > 3  # BOS, then the demo template's "User: Hello\nAssistant:"
    finally:
        routing.hook.tokenizer.close()


def test_only_the_gateways_reach_the_event_ports_and_nothing_else_opens(rendered):
    """The component adds two policies, gateway pods -> node pods' event ports, and changes no other."""
    plain = {o["metadata"]["name"]: o for o in rendered["overlays/gpu"] if o["kind"] == "NetworkPolicy"}
    precise = {o["metadata"]["name"]: o for o in rendered[GPU] if o["kind"] == "NetworkPolicy"}
    assert set(precise) - set(plain) == NEW_POLICIES
    assert all(precise[name] == policy for name, policy in plain.items())
    event_ports = {p["name"] for p in _container(rendered[GPU], "node")["ports"] if p["name"].startswith("kv-")}
    assert event_ports == {"kv-events-0", "kv-replay-0"}
    for name in NEW_POLICIES:
        spec = precise[name]["spec"]
        for rule in spec.get("ingress", []) + spec.get("egress", []):
            assert {p["port"] for p in rule["ports"]} == event_ports
            for peer in rule.get("from", []) + rule.get("to", []):
                assert set(peer) == {"podSelector"}, peer
    for policy in precise.values():  # Prometheus and anyone else: never the event ports
        for rule in policy["spec"].get("ingress", []):
            if event_ports & {p.get("port") for p in rule.get("ports", [])}:
                assert [p["podSelector"]["matchLabels"] for p in rule["from"]] == [GATEWAY]


def test_the_docs_say_how_to_turn_it_on_and_what_to_watch():
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    section = doc.split("## Precise prefix routing", 1)[1].split("\n## ", 1)[0]
    for needed in ("components/precise-prefix", "overlays/cpu-demo-precise", "kv-events-0", "kv-replay-0",
                   "appliance_routing_kv_index_usable", "appliance_routing_prefix_source_total",
                   "precise-with-fallback", "discovery.kv_events", "engine.kv_events"):
        assert needed in section, needed
