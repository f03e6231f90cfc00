"""Issue 21, item 3: the rendered Kubernetes manifests hold only the powers and secrets each part needs, and fail
in predictable ways. Checked offline on what `kubectl kustomize` renders for every overlay (plus the optional
tracing component): bounded disk (sizeLimit, ephemeral-storage), egress policies, locked-down containers, secrets
only as read-only files, credentials separated by role (Prometheus: the metrics token; Alertmanager: the alerts
token; never the admin token), a disruption budget and autoscaler floor that keep one node pod through a drain.

The checks are functions over rendered objects, each with a test that it flags a broken manifest, so that a
passing run means the property holds and not that the check looked at nothing."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from appliance.settings import Settings
from tests.kubernetes.manifests import DEPLOY, render, validate

kubectl = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed")

WORKLOAD_OVERLAYS = ["overlays/gpu", "overlays/cpu-demo", "base"]
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
SECRETISH = re.compile(r"TOKEN(?!IZER)|KEYS?$|_KEY_|PASSWORD|SECRET|CREDENTIAL", re.IGNORECASE)  # not TOKENIZER
SECRETS_DIR = "/run/secrets/appliance"
#: kubelet's default container log rotation (containerLogMaxSize 10Mi x containerLogMaxFiles 5): what a
#: container's stdout may hold on the node besides its volumes, counted in its ephemeral-storage.
CONTAINER_LOGS = 50 * 2**20
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text: str | int) -> int:
    """A Kubernetes storage quantity in bytes (``4Gi``, ``500M``, ``1024``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT])?", str(text))
    assert match, f"not a quantity: {text!r}"
    return int(float(match[1]) * UNITS.get(match[2] or "", 1))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {path: render(path) for path in WORKLOAD_OVERLAYS}


@pytest.fixture(scope="module")
def with_tracing(tmp_path_factory) -> list[dict[str, Any]]:
    """cpu-demo with the optional tracing component (an OTLP endpoint and the egress it needs), as an overlay of
    an operator's would add it (kustomize takes relative paths only)."""
    root = tmp_path_factory.mktemp("tracing-overlay")
    overlay = root / "kustomization.yaml"
    overlay.write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "overlays" / "cpu-demo", root)],
        "components": [os.path.relpath(DEPLOY / "components" / "tracing", root)]}))
    out = subprocess.run([kubectl, "kustomize", str(root)], check=True, capture_output=True, text=True)
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for obj in objects:
        validate(obj)
    return objects


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "the checks read matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def component(workload: dict[str, Any]) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


# -- the checks ------------------------------------------------------------------------------------------------

def disk_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Every emptyDir has a sizeLimit; every container requests and limits ephemeral-storage; the pod's limits
    cover its disk-backed emptyDirs plus the container logs (else the pod is evicted before a volume reaches its
    own limit, and the eviction message names the wrong cause)."""
    problems = []
    for workload in workloads(objects):
        name, pod = workload["metadata"]["name"], pod_of(workload)
        disk = 0
        for volume in pod.get("volumes", []):
            if "emptyDir" in volume:
                limit = (volume["emptyDir"] or {}).get("sizeLimit")
                if limit is None:
                    problems.append(f"{name}: emptyDir {volume['name']} has no sizeLimit")
                elif (volume["emptyDir"] or {}).get("medium") != "Memory":
                    disk += quantity(limit)
        requested = limited = 0
        for container in containers(pod):
            resources = container.get("resources", {})
            request = resources.get("requests", {}).get("ephemeral-storage")
            limit = resources.get("limits", {}).get("ephemeral-storage")
            if request is None or limit is None:
                problems.append(f"{name}/{container['name']}: no ephemeral-storage request and limit")
                continue
            requested += quantity(request)
            limited += quantity(limit)
            if quantity(request) > quantity(limit):
                problems.append(f"{name}/{container['name']}: ephemeral-storage request above its limit")
        if limited and limited < disk + CONTAINER_LOGS:
            problems.append(f"{name}: ephemeral-storage limits {limited} < emptyDirs {disk} + container logs")
        if requested and requested < disk:
            problems.append(f"{name}: ephemeral-storage requests {requested} < emptyDirs {disk}")
    return problems


def lockdown_problems(objects: list[dict[str, Any]]) -> list[str]:
    problems = []
    for workload in workloads(objects):
        name, pod = workload["metadata"]["name"], pod_of(workload)
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            problems.append(f"{name}: shares a host namespace")
        for container in containers(pod):
            context = container.get("securityContext", {})
            where = f"{name}/{container['name']}"
            if context.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot")) is not True:
                problems.append(f"{where}: may run as root")
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: privilege escalation allowed")
            if context.get("privileged"):
                problems.append(f"{where}: privileged")
            if context.get("capabilities", {}).get("drop") != ["ALL"] or context.get("capabilities", {}).get("add"):
                problems.append(f"{where}: capabilities not all dropped")
            if context.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: writable root filesystem")
    return problems


def secret_problems(objects: list[dict[str, Any]]) -> list[str]:
    """No secret in an environment variable (neither a literal value nor secretKeyRef/envFrom: the environment
    is inherited by every child process and shown by `kubectl describe`); secrets come as files from read-only
    Secret volumes, mode 0400 (or 0440 with the pod's fsGroup); every *_FILE variable points into one."""
    problems = []
    for workload in workloads(objects):
        name, pod = workload["metadata"]["name"], pod_of(workload)
        secret_volumes = {}
        for volume in pod.get("volumes", []):
            sources = ([volume["secret"]] if "secret" in volume else
                       [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s])
            if not sources:
                continue
            secret_volumes[volume["name"]] = volume
            mode = (volume.get("secret") or volume.get("projected") or {}).get("defaultMode")
            modes = {mode, *(item.get("mode") for s in sources for item in s.get("items", []))} - {None}
            if mode is None:
                problems.append(f"{name}: secret volume {volume['name']} without defaultMode (0644 by default)")
            for m in modes:
                if m not in (0o400, 0o440) or (m == 0o440 and not pod.get("securityContext", {}).get("fsGroup")):
                    problems.append(f"{name}: secret volume {volume['name']} mode {m:o}")
        for container in containers(pod):
            mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
            secret_paths = []
            for volume_name in secret_volumes:
                if volume_name in mounts:
                    secret_paths.append(mounts[volume_name]["mountPath"])
                    if mounts[volume_name].get("readOnly") is not True:
                        problems.append(f"{name}/{container['name']}: secret volume {volume_name} writable")
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    problems.append(f"{name}/{container['name']}: envFrom a Secret")
            for env in container.get("env", []):
                where = f"{name}/{container['name']}: env {env['name']}"
                if "secretKeyRef" in env.get("valueFrom", {}):
                    problems.append(f"{where} from a Secret")
                if env["name"].endswith("_FILE"):
                    if not any(env.get("value", "").startswith(p.rstrip("/") + "/") for p in secret_paths):
                        problems.append(f"{where} does not point into a mounted Secret volume")
                elif SECRETISH.search(env["name"]) and env.get("value"):
                    problems.append(f"{where} holds a literal secret")
    return problems


def policies(objects: list[dict[str, Any]], kind: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "NetworkPolicy" and kind in o["spec"].get("policyTypes", [])
            and selects(o["spec"]["podSelector"], labels)]


def egress_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Every workload's pods are selected by an Egress policy; no rule is open to everywhere (no `to`, or an
    ipBlock of a whole address family); DNS goes to kube-dns only."""
    problems = []
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selected = policies(objects, "Egress", labels)
        if not selected:
            problems.append(f"{name}: no egress NetworkPolicy")
        for policy in selected:
            for rule in policy["spec"].get("egress", []):
                if not rule.get("to"):
                    problems.append(f"{policy['metadata']['name']}: egress rule open to every destination")
                for peer in rule.get("to", []):
                    if peer.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0"):
                        problems.append(f"{policy['metadata']['name']}: egress to {peer['ipBlock']['cidr']}")
                if {p.get("port") for p in rule.get("ports", [])} & {53, "dns"}:
                    dns = [p for p in rule.get("to", []) if p.get("podSelector", {}).get("matchLabels", {})
                           .get("k8s-app") == "kube-dns"]
                    if len(dns) != len(rule.get("to", [])):
                        problems.append(f"{policy['metadata']['name']}: DNS to something other than kube-dns")
    return problems


def egress_allows(objects: list[dict[str, Any]], source: dict[str, str], port: int | str,
                  dest_labels: dict[str, str] | None = None, namespace: str | None = None) -> bool:
    """Whether some Egress policy selecting ``source`` allows ``port`` to pods labelled ``dest_labels`` (in the
    policy's own namespace unless ``namespace``)."""
    for policy in policies(objects, "Egress", source):
        for rule in policy["spec"].get("egress", []):
            if rule.get("ports") and port not in [p.get("port") for p in rule["ports"]]:
                continue
            for peer in rule.get("to", []):
                ns = peer.get("namespaceSelector")
                if ns is not None and namespace is None:
                    continue
                if ns is not None and not selects(ns, {"kubernetes.io/metadata.name": namespace}):
                    continue
                if ns is None and namespace is not None:
                    continue
                if dest_labels is not None and selects(peer.get("podSelector", {}), dest_labels):
                    return True
    return False


# -- disk ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", WORKLOAD_OVERLAYS)
def test_every_empty_dir_and_container_has_bounded_disk(rendered, overlay):
    assert disk_problems(rendered[overlay]) == []


def test_the_node_state_volume_holds_the_engine_logs_and_caches(rendered):
    """The state volume takes each engine's log and its rotated copies (engine_log_backups + 1 files of
    engine_log_max_bytes, settings defaults unless the pod's environment sets them) and the compile caches; the
    caches are pointed at it, so /tmp stays small."""
    defaults = Settings()
    for overlay in ("overlays/gpu", "overlays/cpu-demo"):
        node = next(w for w in workloads(rendered[overlay]) if w["kind"] == "StatefulSet")
        pod = pod_of(node)
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        replicas = int(env["APPLIANCE_REPLICAS"])
        backups = int(env.get("APPLIANCE_ENGINE_LOG_BACKUPS", defaults.engine.log_backups))
        max_bytes = int(env.get("APPLIANCE_ENGINE_LOG_MAX_BYTES", defaults.engine.log_max_bytes))
        logs = replicas * (backups + 1) * max_bytes
        state = next(v for v in pod["volumes"] if v["name"] == "state")
        assert quantity(state["emptyDir"]["sizeLimit"]) >= logs + 2**30, "room for logs plus 1 GiB of caches"
        for cache in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
            assert env[cache].startswith("/var/lib/appliance/"), cache


def test_the_disk_check_can_fail(rendered):
    objects = copy.deepcopy(rendered["overlays/gpu"])
    node = next(w for w in workloads(objects) if w["kind"] == "StatefulSet")
    next(v for v in pod_of(node)["volumes"] if v["name"] == "tmp")["emptyDir"].pop("sizeLimit", None)
    pod_of(node)["containers"][0]["resources"]["requests"].pop("ephemeral-storage", None)
    problems = disk_problems(objects)
    assert any("emptyDir tmp has no sizeLimit" in p for p in problems)
    assert any("no ephemeral-storage" in p for p in problems)


# -- containers and secrets ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", WORKLOAD_OVERLAYS)
def test_containers_run_locked_down(rendered, overlay):
    assert lockdown_problems(rendered[overlay]) == []


def test_the_lockdown_check_can_fail(rendered):
    objects = copy.deepcopy(rendered["overlays/gpu"])
    gateway = next(w for w in workloads(objects) if w["kind"] == "Deployment")
    context = pod_of(gateway)["containers"][0]["securityContext"]
    context["capabilities"] = {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    context["allowPrivilegeEscalation"] = True
    assert len(lockdown_problems(objects)) == 2


@pytest.mark.parametrize("overlay", WORKLOAD_OVERLAYS)
def test_no_secret_travels_in_the_environment(rendered, overlay):
    assert secret_problems(rendered[overlay]) == []


def test_the_secret_check_can_fail(rendered):
    objects = copy.deepcopy(rendered["overlays/gpu"])
    gateway = next(w for w in workloads(objects) if w["kind"] == "Deployment")
    env = pod_of(gateway)["containers"][0]["env"]
    env.append({"name": "APPLIANCE_ADMIN_TOKEN", "value": "hunter2"})
    env.append({"name": "APPLIANCE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    env.append({"name": "APPLIANCE_METRICS_TOKEN_FILE", "value": "/etc/appliance/token"})
    problems = secret_problems(objects)
    assert len(problems) == 3, problems


#: What each role is given (file name under SECRETS_DIR -> setting's variable). Alertmanager posts to the gateway
#: Service only, so node pods do not hold the alerts token. A node's engines run as the node's user and can read
#: whatever it holds: nodes get the engine key (their engines require it), the lease token (a restart lease,
#: nothing else) and the read-only metrics token, never the admin token or the clients' API keys.
ROLE_FILES = {
    "gateway": {"admin-token": "APPLIANCE_ADMIN_TOKEN_FILE", "api-keys": "APPLIANCE_API_KEYS_FILE",
                "metrics-token": "APPLIANCE_METRICS_TOKEN_FILE", "alerts-token": "APPLIANCE_ALERTS_TOKEN_FILE",
                "lease-token": "APPLIANCE_GATEWAY__LEASE_TOKEN_FILE",
                "engine-key": "APPLIANCE_GATEWAY__ENGINE_KEY_FILE",
                "quota-store-password": "APPLIANCE_QUOTA_STORE__PASSWORD_FILE"},
    "quota-store": {"quota-store-password": "QUOTA_STORE_PASSWORD_FILE"},
    "node": {"engine-key": "APPLIANCE_GATEWAY__ENGINE_KEY_FILE", "lease-token": "APPLIANCE_GATEWAY__LEASE_TOKEN_FILE",
             "metrics-token": "APPLIANCE_METRICS_TOKEN_FILE"},
}
#: What a compromised engine on a node pod must not find there: the fleet's admin API, every tenant's key, and
#: the quota store (where it could refill any tenant's buckets).
NEVER_ON_NODES = {"admin-token", "api-keys", "alerts-token", "quota-store-password"}


def _secret_files(pod: dict[str, Any]) -> dict[str, str]:
    """File name in the pod's secret volume -> the Secret it comes from."""
    files = {}
    for volume in pod["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            for item in source.get("secret", {}).get("items", []):
                files[item["path"]] = source["secret"]["name"]
    return files


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/cpu-demo"])
def test_each_role_gets_its_own_credentials_as_files(rendered, overlay):
    secrets = {}
    for workload in workloads(rendered[overlay]):
        role = component(workload)
        pod = pod_of(workload)
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        files = _secret_files(pod)
        assert set(files) == set(ROLE_FILES[role]), role
        for file, variable in ROLE_FILES[role].items():
            assert env[variable] == f"{SECRETS_DIR}/{file}"
        assert "APPLIANCE_ALERTS_TOKEN_FILE" in env or role != "gateway"
        for file, secret in files.items():
            assert secrets.setdefault(file, secret) == secret, "one Secret per credential, the same in both roles"
    # One Secret per audience: what Prometheus, Alertmanager and node pods may read holds nothing else.
    assert len({secrets[file] for file in ("metrics-token", "alerts-token", "admin-token", "lease-token",
                                           "engine-key", "quota-store-password")}) == 6


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/cpu-demo", "base"])
def test_node_pods_hold_neither_the_admin_token_nor_the_api_keys(rendered, overlay):
    """A node's engines (vLLM, its plugins, model code) run as the node's user: anything the pod mounts or is
    given in its environment, they can read. So the pod gets no admin token and no client key, from any source."""
    node = next(w for w in workloads(rendered[overlay]) if component(w) == "node")
    pod = pod_of(node)
    assert not NEVER_ON_NODES & set(_secret_files(pod))
    sources = [source.get("secret", {}).get("name") for volume in pod["volumes"]
               for source in volume.get("projected", {}).get("sources", [])]
    sources += [volume.get("secret", {}).get("secretName") for volume in pod["volumes"]]
    assert "appliance-secrets" not in sources  # the Secret holding the admin token and the API keys
    for container in pod["containers"] + pod.get("initContainers", []):
        names = {env["name"] for env in container.get("env", [])}
        assert not {name for name in names if re.search(r"ADMIN_TOKEN|API_KEYS|ALERTS_TOKEN", name)}, names
        refs = yaml.safe_dump(container.get("env", [])) + yaml.safe_dump(container.get("envFrom", []))
        assert "appliance-secrets" not in refs


def test_the_node_check_can_fail(rendered):
    objects = copy.deepcopy(rendered["overlays/gpu"])
    node = next(w for w in workloads(objects) if component(w) == "node")
    pod_of(node)["volumes"][-1]["projected"]["sources"].append(
        {"secret": {"name": "appliance-secrets", "items": [{"key": "admin-token", "path": "admin-token"}]}})
    with pytest.raises(AssertionError):
        test_node_pods_hold_neither_the_admin_token_nor_the_api_keys({"overlays/gpu": objects}, "overlays/gpu")


def _bearer_secret(endpoint: dict[str, Any]) -> dict[str, str] | None:
    auth = endpoint.get("authorization") or endpoint.get("httpConfig", {}).get("authorization") or {}
    return auth.get("credentials")


def test_prometheus_and_alertmanager_use_their_own_tokens(rendered):
    objects = rendered["overlays/gpu"]
    gateway = next(w for w in workloads(objects) if component(w) == "gateway")
    files = _secret_files(pod_of(gateway))
    service_monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    pod_monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    appliance_metrics = [e for e in service_monitor["spec"]["endpoints"] + pod_monitor["spec"]["podMetricsEndpoints"]
                         if e["port"] == "http"]
    assert len(appliance_metrics) == 2
    for endpoint in appliance_metrics:
        assert _bearer_secret(endpoint) == {"name": files["metrics-token"], "key": "metrics-token"}
    alertmanager = next(o for o in objects if o["kind"] == "AlertmanagerConfig")
    receiver = next(r for r in alertmanager["spec"]["receivers"] if r["name"] == "appliance")
    assert _bearer_secret(receiver["webhookConfigs"][0]) == {"name": files["alerts-token"], "key": "alerts-token"}
    monitoring = yaml.safe_dump([o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com")])
    assert "admin-token" not in monitoring and files["admin-token"] not in monitoring


# -- network ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", WORKLOAD_OVERLAYS)
def test_every_workload_has_a_closed_egress_policy(rendered, overlay):
    objects = rendered[overlay]
    assert egress_problems(objects) == []
    gateway = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "gateway"}
    node = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "node"}
    dns = {"k8s-app": "kube-dns"}
    for role in (gateway, node):
        assert egress_allows(objects, role, 53, dns, namespace="kube-system")
    engines = [p["name"] for p in pod_of(next(w for w in workloads(objects) if w["kind"] == "StatefulSet"))
               ["containers"][0]["ports"] if p["name"].startswith("engine-")]
    assert engines and all(egress_allows(objects, gateway, port, node) for port in engines)
    assert not any(egress_allows(objects, node, port, node) for port in engines), "nodes never call nodes"
    assert not egress_allows(objects, gateway, "http", node), "gateways never call the node's own gateway"


def test_the_egress_check_can_fail(rendered):
    objects = [o for o in copy.deepcopy(rendered["overlays/gpu"])
               if not (o["kind"] == "NetworkPolicy" and "node" in o["metadata"]["name"]
                       and "Egress" in o["spec"]["policyTypes"])]
    assert egress_problems(objects) == ["appliance-node: no egress NetworkPolicy"]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy" and "Egress" in o["spec"]["policyTypes"])
    policy["spec"]["egress"].append({"ports": [{"port": 443}]})
    assert "egress rule open to every destination" in " ".join(egress_problems(objects))


def test_the_tracing_component_opens_egress_to_its_endpoint_only(with_tracing):
    assert egress_problems(with_tracing) == [] and secret_problems(with_tracing) == []
    for workload in [w for w in workloads(with_tracing) if component(w) != "quota-store"]:  # Redis sends no traces
        env = {e["name"]: e.get("value") for e in pod_of(workload)["containers"][0]["env"]}
        endpoint = urlsplit(env["APPLIANCE_OTLP_TRACES_ENDPOINT"])
        host = endpoint.hostname.split(".")
        service, namespace = host[0], host[1]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        policy = next(p for p in policies(with_tracing, "Egress", labels) if "otlp" in p["metadata"]["name"])
        peer = policy["spec"]["egress"][0]["to"][0]
        assert egress_allows(with_tracing, labels, endpoint.port, peer["podSelector"]["matchLabels"], namespace)
        assert service and not egress_allows(with_tracing, labels, endpoint.port + 1,
                                             peer["podSelector"]["matchLabels"], namespace)


@pytest.mark.parametrize("overlay", WORKLOAD_OVERLAYS)
def test_node_metrics_port_admits_only_prometheus(rendered, overlay):
    """/metrics of a node pod (port http, where its own gateway answers) is for Prometheus: gateways talk to the
    engines' ports only. The gateway pods' /metrics shares the API's port, so there the metrics token guards it."""
    objects = rendered[overlay]
    node = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "node"}
    sources = []
    for policy in policies(objects, "Ingress", node):
        for rule in policy["spec"]["ingress"]:
            if not rule.get("ports") or "http" in [p["port"] for p in rule["ports"]]:
                sources += rule.get("from", [{}])
    assert sources, "some ingress rule names the http port"
    for peer in sources:
        assert peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "prometheus"
        assert "namespaceSelector" in peer


# -- availability ----------------------------------------------------------------------------------------------

def _evictions_allowed(pdb: dict[str, Any], healthy: int, expected: int) -> int:
    """The Eviction API's disruptionsAllowed for a PodDisruptionBudget (minAvailable or maxUnavailable, whole
    numbers), as the disruption controller computes it."""
    spec = pdb["spec"]
    desired = spec["minAvailable"] if "minAvailable" in spec else expected - spec["maxUnavailable"]
    return max(0, healthy - desired)


def test_a_drain_keeps_one_node_pod_and_is_never_blocked(rendered):
    """For every replica count the autoscaler may choose, evicting node pods (a `kubectl drain` of every
    Kubernetes node in turn, or several at once, each eviction retried until the budget allows it) takes one at a
    time, never leaves zero node pods, and is never stuck while every pod is healthy. Without the autoscaler
    (cpu-demo) the StatefulSet's own replica count gives the same floor."""
    objects = rendered["overlays/gpu"]
    pdb = next(o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "appliance-node")
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    low, high = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    for overlay in ("overlays/gpu", "overlays/cpu-demo"):
        statefulset = next(o for o in rendered[overlay] if o["kind"] == "StatefulSet")
        assert low <= statefulset["spec"]["replicas"] <= high, overlay
    for replicas in range(low, high + 1):
        assert _evictions_allowed(pdb, replicas, replicas) == 1, f"not one at a time at {replicas} node pods"
        healthy = replicas
        while _evictions_allowed(pdb, healthy, replicas):
            healthy -= 1  # evicted; its replacement is not ready yet (model load takes minutes)
        assert healthy == replicas - 1 >= 1, f"a drain can take too many node pods at {replicas}"
    assert pdb["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow", "a crash-looping pod must not block"


def test_gateway_pods_stay_in_the_service_without_engines(rendered):
    """The gateway's readiness is its own (not draining), so with every engine down the Service keeps its
    endpoints and clients get 503 + Retry-After from a gateway instead of a refused connection; node pods stay
    ready only with a serving engine, so the headless Service lists only them."""
    for overlay in ("overlays/gpu", "overlays/cpu-demo"):
        probes = {component(w): pod_of(w)["containers"][0]["readinessProbe"]["httpGet"]["path"]
                  for w in workloads(rendered[overlay]) if component(w) != "quota-store"}
        assert probes == {"gateway": "/health/serving", "node": "/health/ready"}


def test_the_optional_monitoring_egress_admits_exactly_what_prometheus_and_alertmanager_need(rendered):
    """deploy/kubernetes/monitoring-egress (for a monitoring namespace that restricts egress): Prometheus may
    reach every port the ServiceMonitor and PodMonitor scrape, on the pods they select; Alertmanager the port
    its webhook URL names on the gateway pods; no rule is open to everything."""
    policies_ = render("monitoring-egress")
    objects = rendered["overlays/gpu"]
    namespace = next(w for w in workloads(objects))["metadata"]["namespace"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    pods = {component(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads(objects)}
    service_monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    pod_monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    scraped = [("gateway", e["port"]) for e in service_monitor["spec"]["endpoints"]]
    scraped += [("node", e["port"]) for e in pod_monitor["spec"]["podMetricsEndpoints"]]
    assert {role for role, _ in scraped} == {"gateway", "node"}
    for role, port in scraped:
        assert egress_allows(policies_, prometheus, port, pods[role], namespace), (role, port)
    alertmanager = next(o for o in objects if o["kind"] == "AlertmanagerConfig")
    url = urlsplit(next(r for r in alertmanager["spec"]["receivers"] if r["name"] == "appliance")
                   ["webhookConfigs"][0]["url"])
    service_name, service_namespace = url.hostname.split(".")[:2]
    assert service_namespace == namespace
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name)
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == url.port)
    assert selects({"matchLabels": service["spec"]["selector"]}, pods["gateway"])
    assert egress_allows(policies_, {"app.kubernetes.io/name": "alertmanager"}, target, pods["gateway"], namespace)
    assert not egress_allows(policies_, {"app.kubernetes.io/name": "alertmanager"}, target, pods["node"], namespace)
    assert all(rule.get("to") for p in policies_ for rule in p["spec"]["egress"])


def _secret_refs(node: Any) -> Iterator[tuple[str, str]]:
    """(Secret, key) for every reference in a rendered object: projected/secret volume items, secretKeyRef,
    and the Prometheus Operator's {name, key} selectors."""
    if isinstance(node, dict):
        if "secret" in node and isinstance(node["secret"], dict) and "name" in node["secret"]:
            for item in node["secret"].get("items", []):
                yield node["secret"]["name"], item["key"]
        if set(node) >= {"name", "key"} and isinstance(node["name"], str) and node["name"].startswith("appliance-"):
            yield node["name"], node["key"]
        for value in node.values():
            yield from _secret_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _secret_refs(value)


def test_every_secret_the_manifests_need_is_documented(rendered):
    """docs/kubernetes.md tells the operator to create each Secret and key the manifests read."""
    doc = (DEPLOY.parents[1] / "docs" / "kubernetes.md").read_text()
    refs = set(_secret_refs(rendered["overlays/gpu"]))
    assert {("appliance-secrets", "admin-token"), ("appliance-metrics-token", "metrics-token"),
            ("appliance-alerts-token", "alerts-token"), ("appliance-lease-token", "lease-token"),
            ("appliance-engine-key", "engine-key")} <= refs
    missing = [f"{name}/{key}" for name, key in sorted(refs)
               if f"secret generic {name}" not in doc or f"{key}=" not in doc]
    assert not missing, f"docs/kubernetes.md does not say how to create {missing}"


@pytest.mark.parametrize("role", ["gateway", "node"])
def test_the_pods_settings_load_their_secrets_from_the_mounted_files(rendered, role, tmp_path, monkeypatch):
    """Each workload's environment, with its Secret volume's files in a temporary directory and the ConfigMap
    file it mounts, gives settings holding exactly that role's credentials (and no other)."""
    from appliance.settings import load_settings

    workload = next(w for w in workloads(rendered["overlays/gpu"]) if component(w) == role)
    pod = pod_of(workload)
    values = {"admin-token": "admin-secret", "api-keys": "key-one\nkey-two\n", "metrics-token": "metrics-secret",
              "alerts-token": "alerts-secret", "lease-token": "lease-secret", "engine-key": "engine-secret",
              "quota-store-password": "store-secret"}
    for file in _secret_files(pod):
        (tmp_path / file).write_text(values[file])
    for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    for env in pod["containers"][0]["env"]:
        if env["name"].startswith("APPLIANCE_") and env["name"] not in ("APPLIANCE_MODEL", "APPLIANCE_DEVICE"):
            monkeypatch.setenv(env["name"], env["value"].replace(SECRETS_DIR, str(tmp_path)))
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path / "state"))
    settings = load_settings(DEPLOY / "base" / "appliance.yaml")
    assert settings.role == role
    gateway = role == "gateway"
    assert settings.gateway.admin_token == ("admin-secret" if gateway else None)
    assert settings.gateway.api_keys == (["key-one", "key-two"] if gateway else [])
    assert settings.gateway.metrics_token == "metrics-secret"
    assert settings.gateway.alerts_token == ("alerts-secret" if gateway else None)
    # Both roles: the key the engines require (gateways send it) and the restart lease's token.
    assert settings.gateway.engine_key == "engine-secret" and settings.gateway.lease_token == "lease-secret"
    # Gateways share the tenants' quota in the quota store; node pods have no tenants to meter.
    assert settings.quota_store.kind == ("redis" if gateway else "memory")
    assert settings.quota_store.password == ("store-secret" if gateway else None)
