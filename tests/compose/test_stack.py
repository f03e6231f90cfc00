"""compose.yaml run for real (podman + docker-compose 1.29, CPU profile, demo model, 1 replica): what an operator
gets from `docker compose up`, checked against the running containers, not against `docker-compose config`.

The module's tests share one stack and run in file order; the last one takes it down (the drain test).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.alertmanager import alert_status, delivered
from tests.compose.stack import EXTRA_ARGS, MAX_MODEL_LEN, REPO, SERVED_MODEL_NAME, SERVICES, ComposeStack
from tests.polling import eventually
from tests.processes import paused

pytestmark = pytest.mark.compose  # run apart, after the suite, by scripts/test (its images build meanwhile)

STREAMS = 6  # concurrent long streams in flight while `docker-compose down` runs


def query(stack: ComposeStack, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{stack.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", response
    return response["data"]["result"]


def exec_in(stack: ComposeStack, service: str, *command: str) -> str:
    return stack.podman("exec", stack.container(service), *command).stdout


def test_the_cpu_profile_builds_the_demo_model_as_its_user_and_streams(compose_stack: ComposeStack) -> None:
    """Unset APPLIANCE_MODEL reaches the container unset (not "", which read as model "."), so the appliance
    builds the demo model into the models volume, which the non-root image user can write."""
    env = exec_in(compose_stack, "appliance-cpu", "env")
    assert "APPLIANCE_MODEL=" not in env
    owner = exec_in(compose_stack, "appliance-cpu", "stat", "-c", "%u", "/var/lib/appliance/models/demo-int8")
    assert owner.strip() == "10001"
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "What is a class?"}], "max_tokens": 16,
            "stream": True, "ignore_eos": True}
    assert httpx.post(f"{compose_stack.gateway}/v1/chat/completions", json=body, timeout=30).status_code == 401
    with httpx.stream("POST", f"{compose_stack.gateway}/v1/chat/completions", json=body, timeout=120,
                      headers=compose_stack.client_headers) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert events[-1] == "data: [DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_env_file_configures_the_model_and_the_engine(compose_stack: ComposeStack) -> None:
    """Issue 19: the served name, max_model_len and extra args set in the operator's env file reach vLLM's command
    line and the gateway's /v1/models (compose.yaml used to drop them: `demo` and 1024 whatever was configured)."""
    argv = compose_stack.vllm_server().cmdline()
    assert argv[argv.index("--served-model-name") + 1] == SERVED_MODEL_NAME, argv
    assert argv[argv.index("--max-model-len") + 1] == str(MAX_MODEL_LEN), argv
    assert EXTRA_ARGS in argv, argv
    card = httpx.get(f"{compose_stack.gateway}/v1/models", timeout=10,
                     headers=compose_stack.client_headers).json()["data"][0]
    assert (card["id"], card["max_model_len"]) == (SERVED_MODEL_NAME, MAX_MODEL_LEN)
    # tini runs `appliance up ... --config FILE`: the file `appliance reload` reads again, mounted from the host.
    assert "/etc/appliance/appliance.yaml" in compose_stack.init_process().cmdline()


def test_the_image_serves_the_runbooks_its_alerts_link(compose_stack: ComposeStack) -> None:
    """Air-gapped sites: every alert's runbook_url points at the appliance's own /runbooks, so the image must carry
    them (docs/runbooks, copied next to the package) and the gateway serve them."""
    rules = yaml.safe_load((REPO / "alerts" / "alerts.rules.yaml").read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    for name in names:
        response = httpx.get(f"{compose_stack.gateway}/runbooks/{name}", timeout=30)
        assert response.status_code == 200 and response.text.startswith(f"# {name}"), (name, response.status_code)


def test_vllm_gets_shared_memory_and_tini_is_pid_1(compose_stack: ComposeStack) -> None:
    shm_kib = int(exec_in(compose_stack, "appliance-cpu", "df", "-k", "--output=size", "/dev/shm").split()[-1])
    assert shm_kib >= 8 * 1024 * 1024 - 1  # compose's shm_size (8gb), not Docker's 64 MB
    assert compose_stack.init_process().name() == "tini"


def test_monitoring_is_published_on_loopback_only_and_prometheus_lifecycle_is_off(
        compose_stack: ComposeStack) -> None:
    for service, port in (("prometheus", 9090), ("alertmanager", 9093)):
        published = compose_stack.compose("port", service, str(port)).stdout.strip()
        assert published.startswith("127.0.0.1:"), (service, published)
    gateway = compose_stack.compose("port", "appliance-cpu", "8000").stdout.strip()
    assert gateway.startswith("127.0.0.1:"), gateway  # a wider bind is the operator's explicit choice
    reload = httpx.post(f"{compose_stack.prometheus}/-/reload", timeout=10)
    assert reload.status_code == 403 and "Lifecycle API is not enabled" in reload.text


def test_prometheus_scrapes_the_gateway_and_the_engine_and_loads_the_rules(compose_stack: ComposeStack) -> None:
    def targets_up() -> dict[str, int] | None:
        targets = httpx.get(f"{compose_stack.prometheus}/api/v1/targets", timeout=10).json()["data"]
        up = {}
        for target in targets["activeTargets"]:
            up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + (target["health"] == "up")
        return up if up.get("appliance") and up.get("vllm") else None

    up = eventually(targets_up, 60, "the gateway and engine targets up in Prometheus")
    assert up["vllm"] == 1  # the engine, discovered through /sd/targets as appliance:8100 on the compose network
    assert eventually(lambda: query(compose_stack, 'vllm:num_requests_running{replica="replica-0"}'), 30,
                      "vLLM's own metrics scraped from the engine")
    groups = httpx.get(f"{compose_stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    names = {rule["name"] for group in groups for rule in group["rules"]}
    assert "ApplianceReplicaNotReady" in names and len(names) > 20
    assert all(rule.get("health") != "err" for group in groups for rule in group["rules"])


def test_a_killed_engine_fires_through_alertmanager_resolves_and_leaves_no_zombie(
        compose_stack: ComposeStack) -> None:
    """Two crashes in a row. vLLM's engine core outlives a killed server and is re-parented to PID 1; without an
    init that reaps, each crash leaves it as a zombie for the container's life."""
    for crash in range(2):
        victim = compose_stack.vllm_server()
        victim.send_signal(signal.SIGKILL)
        eventually(lambda: not compose_stack.ready(), 60, "the gateway not ready without its only replica")
        if crash == 0:
            selector = 'ALERTS{alertname="ApplianceReplicaNotReady", replica="replica-0", alertstate="firing"}'
            eventually(lambda s=selector: query(compose_stack, s), 90, "ApplianceReplicaNotReady firing")
            status = eventually(lambda: alert_status(compose_stack.alertmanager, "ApplianceReplicaNotReady",
                                                     "replica-0"), 60, "ApplianceReplicaNotReady in Alertmanager")
            assert delivered(status), status
        compose_stack.wait_ready(timeout=600)
        assert compose_stack.vllm_server().pid != victim.pid
        if crash == 0:
            eventually(lambda s=selector: not query(compose_stack, s), 60, "the alert resolved in Prometheus")
            eventually(lambda: not alert_status(compose_stack.alertmanager, "ApplianceReplicaNotReady",
                                                "replica-0"), 60,
                       "the alert resolved in Alertmanager")
    time.sleep(2)
    assert compose_stack.zombies() == []
    assert "replica-0: engine exited with 137" in compose_stack.logs("appliance-cpu", tail=5000)


def test_engine_output_is_in_the_container_log_and_in_the_rotated_file(compose_stack: ComposeStack) -> None:
    logs = compose_stack.logs("appliance-cpu", tail=5000)
    assert "[replica-0] " in logs
    files = exec_in(compose_stack, "appliance-cpu", "ls", "/var/lib/appliance/logs").split()
    assert "engine-0.log" in files


def test_the_runbooks_compose_commands_work(compose_stack: ComposeStack) -> None:
    """docs/runbooks/README.md's compose forms, run as written there: `appliance status` inside the container, and
    one replica's engine lines picked out of `docker compose logs --no-log-prefix` by their prefix."""
    logs = compose_stack.compose("logs", "--no-color", "--no-log-prefix", "appliance-cpu", timeout=60).stdout
    engine_lines = [line for line in logs.splitlines() if "[replica-0]" in line]
    assert engine_lines and all(line.startswith("[replica-0] ") for line in engine_lines), engine_lines[:5]
    status = compose_stack.compose("exec", "-T", "appliance-cpu", "appliance", "status", timeout=60).stdout
    assert "replica-0" in status and "ready" in status, status


def _status(process) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":\t") for line in
                                                     Path(f"/proc/{process.pid}/status").read_text().splitlines())}


def test_every_service_runs_without_capabilities_read_only_and_without_privilege_gain(
        compose_stack: ComposeStack) -> None:
    """Issue 21, checked on the running processes (the kernel's view, not compose's): no_new_privs everywhere;
    no capability in the monitoring services; in the appliance's container only CAP_SETUID, CAP_SETGID and CAP_KILL
    (PID 1, and the appliance, uid 10001, which starts and stops its engines as their own user) and none at all in
    the engines (uid 10002); the root filesystems are read-only."""
    engine_caps = 1 << 5 | 1 << 6 | 1 << 7  # CAP_KILL, CAP_SETGID, CAP_SETUID
    for service in SERVICES:
        status = _status(compose_stack.init_process(service))
        allowed = engine_caps if service == "appliance-cpu" else 0
        assert int(status["CapEff"], 16) == allowed and int(status["CapBnd"], 16) == allowed, (service, status)
        assert status["NoNewPrivs"] == "1", service
    gateway = next(p for p in compose_stack.processes() if p.uids().real == 10001)  # tini's child: the appliance
    status = _status(gateway)
    assert status["NoNewPrivs"] == "1"
    assert status["Uid"].split()[0] == "10001" and "10001" in status["Groups"].split(), status["Groups"]
    assert int(status["CapEff"], 16) == engine_caps and int(status["CapAmb"], 16) == 0  # cleared for its children
    vllm = compose_stack.vllm_server()
    for engine in (vllm, *vllm.children(recursive=True), vllm.parent()):
        status = _status(engine)
        assert status["Uid"].split() == ["10002"] * 4 and "10001" not in status["Groups"].split(), engine.cmdline()
        assert all(int(status[c], 16) == 0 for c in ("CapEff", "CapPrm", "CapInh", "CapAmb")), engine.cmdline()
    for service in SERVICES:
        inspect = json.loads(compose_stack.podman("inspect", compose_stack.container(service)).stdout)[0]
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True, service
        written = compose_stack.podman("exec", compose_stack.container(service), "touch", "/written", check=False)
        assert written.returncode != 0 and "Read-only file system" in written.stderr, (service, written.stderr)
    # The demo model, logs and torch's compile cache still have somewhere to go: the stack served above.
    written = compose_stack.podman("exec", "--user", "10001", compose_stack.container("appliance-cpu"), "touch",
                                   "/tmp/x", "/var/lib/appliance/x", check=False)
    assert written.returncode == 0, written.stderr


def test_secrets_arrive_as_private_files_and_each_service_holds_only_its_own(compose_stack: ComposeStack) -> None:
    """Issue 21: no container's environment holds a secret (docker inspect, /proc/<pid>/environ of every process,
    engines included); the secret files are not world-readable; the rendered monitoring files holding tokens are
    0600 and Prometheus'/Alertmanager's; Alertmanager holds the alerts token and Prometheus the metrics token,
    neither the admin token."""
    stack = compose_stack
    every_secret = [stack.admin_token, stack.alerts_token, stack.metrics_token, stack.api_key]
    for service in ["monitoring-config", *SERVICES]:
        container = stack.podman("ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.project}",
                                 "--filter", f"label=com.docker.compose.service={service}").stdout.split()[0]
        env = json.dumps(json.loads(stack.podman("inspect", container).stdout)[0]["Config"]["Env"])
        assert not [s for s in every_secret if s in env], service
    for process in stack.processes():
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert not [s for s in every_secret if s.encode() in environ], process.cmdline()
    modes = exec_in(stack, "appliance-cpu", "stat", "-c", "%a %U %n", "/run/secrets/admin_token",
                    "/run/secrets/api_keys").splitlines()
    assert [line.split()[0] for line in modes] == ["440", "440"], modes
    # What the engines' user (10002, its own group only) can open of them, tried as it: nothing.
    for secret in ("admin_token", "alerts_token", "metrics_token", "api_keys"):
        tried = stack.podman("exec", "--user", "10002:10002", stack.container("appliance-cpu"), "cat",
                             f"/run/secrets/{secret}", check=False)
        assert tried.returncode != 0 and "Permission denied" in tried.stderr, (secret, tried.stdout)
    for service, path, token in (("prometheus", "/etc/prometheus/generated/prometheus.yml", stack.metrics_token),
                                 ("alertmanager", "/etc/alertmanager/generated/alertmanager.yml", stack.alerts_token)):
        assert exec_in(stack, service, "stat", "-c", "%a %u", path).split() == ["600", "65534"], service
        text = exec_in(stack, service, "cat", path)
        assert token in text and stack.admin_token not in text and stack.api_key not in text, service
    # The read-only role: /metrics needs the metrics (or admin) token; Prometheus scraped it above with its own.
    assert httpx.get(f"{stack.gateway}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{stack.gateway}/metrics", timeout=10,
                     headers={"authorization": f"Bearer {stack.metrics_token}"}).status_code == 200
    assert httpx.get(f"{stack.gateway}/admin/status", timeout=10,
                     headers={"authorization": f"Bearer {stack.metrics_token}"}).status_code == 401
    # Alertmanager's webhook got through with the alerts token it holds (a 401 would count nothing): the alerts of
    # the crash test above, or the always-firing Watchdog.
    metrics = {"authorization": f"Bearer {stack.metrics_token}"}

    def webhook_alerts() -> float:
        text = httpx.get(f"{stack.gateway}/metrics", timeout=10, headers=metrics).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("appliance_alert_webhook_alerts_total{"))

    eventually(lambda: webhook_alerts() > 0, 180, "alerts received on /admin/alerts with the alerts token")


def test_only_prometheus_reaches_the_engines(compose_stack: ComposeStack) -> None:
    """Issue 21: the engines listen on the appliance's address on the internal `engines` network only; Prometheus
    shares it (the vLLM target is up, above), Alertmanager does not: neither the name nor the address answers."""
    argv = compose_stack.vllm_server().cmdline()
    assert argv[argv.index("--host") + 1] == "appliance-engines", argv
    inspect = json.loads(compose_stack.podman("inspect", compose_stack.container("appliance-cpu")).stdout)[0]
    address = inspect["NetworkSettings"]["Networks"][f"{compose_stack.project}_engines"]["IPAddress"]
    port = 8100
    probe = "wget -q -T 3 -t 1 -O /dev/null http://{}:{}/health && echo reached || echo refused"
    reached = exec_in(compose_stack, "prometheus", "sh", "-c", probe.format("appliance-engines", port)).strip()
    assert reached == "reached"
    # Prometheus reaches /health and /metrics, nothing else: every other path needs the gateway's engine key.
    for path in ("v1/models", "invocations", "tokenize"):
        got = exec_in(compose_stack, "prometheus", "sh", "-c",
                      probe.replace("/health", f"/{path}").format("appliance-engines", port)).strip()
        assert got == "refused", path
    for target in ("appliance-engines", address, "appliance"):
        got = exec_in(compose_stack, "alertmanager", "sh", "-c", probe.format(target, port)).strip()
        assert got == "refused", target
    # On loopback inside its own container the engine is not listening either: only the internal address.
    local = exec_in(compose_stack, "appliance-cpu", "sh", "-c",
                    f"curl -fsS -m 3 http://127.0.0.1:{port}/health && echo reached || echo refused").strip()
    assert local.endswith("refused"), local


def test_compose_down_drains_in_flight_streams_and_the_appliance_exits_0(compose_stack: ComposeStack) -> None:
    """Last: it takes the stack down. SIGTERM from `docker-compose down` while streams run: readiness turns 503,
    every stream runs to its end, the container exits 0 within the grace period. The vLLM server is paused
    (SIGSTOP) from the streams' first chunk until the 503 is seen, so the streams outlast that check however slow
    the machine (unpaused, 1000 tokens last seconds: a race on a loaded host)."""
    container = compose_stack.container("appliance-cpu")
    waiter = subprocess.Popen(["podman", "wait", container], env=compose_stack.podman.env, stdout=subprocess.PIPE,
                              text=True)
    results: list[list[str]] = []
    started = threading.Barrier(STREAMS + 1)
    threads = [threading.Thread(target=_stream, args=(compose_stack.gateway, compose_stack.client_headers, started,
                                                      results)) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    with paused(compose_stack.vllm_server()):
        signalled = time.monotonic()
        down = compose_stack.popen("down")
        eventually(lambda: not compose_stack.ready(), 30, "readiness 503 after SIGTERM")
        drained_seen = time.monotonic()
    for thread in threads:
        thread.join(timeout=300)
    streamed = time.monotonic()
    exit_code = int(waiter.communicate(timeout=200)[0].strip().splitlines()[-1])
    stopped = time.monotonic() - signalled
    down_out, _ = down.communicate(timeout=200)
    assert drained_seen < streamed, "the streams ended before the appliance saw SIGTERM: nothing was drained"
    assert len(results) == STREAMS
    for events in results:
        assert events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # ran to max_tokens, not cut short
    assert exit_code == 0, down_out
    assert stopped < 150  # compose.yaml's stop_grace_period: exited by itself, not SIGKILLed
    assert down.returncode == 0, down_out


def _stream(gateway: str, headers: dict[str, str], started: threading.Barrier, results: list[list[str]]) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "The import system", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=300, headers=headers) as response:
            lines = response.iter_lines()
            events.append(next(lines))
            started.wait(timeout=120)
            events.extend(line for line in lines if line)
    finally:
        results.append(events)
