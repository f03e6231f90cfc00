"""End to end against real vLLM CPU engines serving the INT8 demo model through the gateway.

The appliance (2 replicas) is the session's shared one (see conftest.py); the tests run in file order and the
last one drains and stops it, so keep the SIGTERM test last.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import ADMIN_TOKEN
from tests.processes import paused

pytestmark = pytest.mark.engine


def test_completion_through_the_gateway(client):
    response = client.completions.create(model="demo", prompt="The class statement", max_tokens=16,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text
    assert response.usage.completion_tokens == 16


def test_streamed_chat_completion(client):
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What is a module?"}], max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage.completion_tokens == 16
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed


def test_engines_run_the_int8_kernel(appliance):
    logs = [(appliance.state_dir / "logs" / f"engine-{i}.log").read_text() for i in range(appliance.replicas)]
    for log in logs:  # vLLM names the linear kernel it picked for the W8A8 INT8 scheme
        assert "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" in log


#: The appliance's own variables an engine may hold: the launcher's and the engine plugin's (never a setting).
ENGINE_VARIABLES = (b"APPLIANCE_ENGINE_GRACE_", b"APPLIANCE_PARENT_", b"APPLIANCE_ENGINE_STATS_")


def test_engines_hold_no_appliance_secret(appliance):
    """Issue 21: the launcher, vLLM's server and its engine core get an allow-listed environment: the admin token
    the appliance was started with is nowhere in /proc/<pid>/environ, nor any setting of the appliance's (a secret,
    a secret file's path: APPLIANCE_*); vLLM's own variables are, its key among them (VLLM_API_KEY, which it
    requires). What the engines hold besides, secret files and the appliance's memory: test_engine_isolation.py."""
    processes = [p for i in range(appliance.replicas)
                 for p in (psutil.Process(appliance.vllm_server_pid(i)), *appliance.engine_core_processes(i))]
    processes += appliance.engine_processes()
    for process in processes:
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert ADMIN_TOKEN.encode() not in environ and b"APPLIANCE_ADMIN_TOKEN=" not in environ, process.cmdline()
        assert b"VLLM_CPU_KVCACHE_SPACE=" in environ or "appliance.engine.launch" not in process.cmdline()
        names = [item.split(b"=", 1)[0] for item in environ.split(b"\0") if item]
        settings = [n for n in names if n.startswith(b"APPLIANCE_") and not n.startswith(ENGINE_VARIABLES)]
        assert not settings, (process.cmdline(), settings)
    for replica in range(appliance.replicas):  # (the engine core's setproctitle overwrites its environ's view)
        assert appliance.engine_environ(replica)["VLLM_API_KEY"], replica


def test_engines_answer_the_gateway_only(appliance):
    """Where the engines can be reached (another container on their network; a cluster without enforced
    NetworkPolicies), a caller without the gateway's engine key gets 401 from each, on /v1 (vLLM's own check)
    and on every other path but /health and /metrics (the appliance's, appliance/engine/guard.py), while the
    same request through the gateway is served: keys, quotas and admission cannot be skipped by going direct."""
    body = {"model": "demo", "prompt": "The class statement", "max_tokens": 4}
    key = appliance.engine_key()
    for replica in range(appliance.replicas):
        engine = f"http://127.0.0.1:{appliance.engine_port(replica)}"
        for headers in ({}, {"authorization": "Bearer not-the-key"}, {"authorization": f"Bearer {ADMIN_TOKEN}"}):
            for path in ("/v1/completions", "/invocations", "/tokenize"):
                refused = httpx.post(f"{engine}{path}", json=body, headers=headers, timeout=30)
                assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}, (path, headers)
            assert httpx.get(f"{engine}/v1/models", headers=headers, timeout=30).status_code == 401
        assert httpx.get(f"{engine}/health", timeout=30).status_code == 200  # the gateway's probe
        assert httpx.get(f"{engine}/metrics", timeout=30).status_code == 200  # its load poll, Prometheus
        direct = httpx.post(f"{engine}/v1/completions", json=body, timeout=60,
                            headers={"authorization": f"Bearer {key}"})
        assert direct.status_code == 200, direct.text  # the key is what opens it
    through = httpx.post(f"{appliance.url}/v1/completions", json=body, timeout=60)
    assert through.status_code == 200, through.text


def test_both_replicas_serve_traffic(appliance):
    def one(_: int) -> str:
        response = httpx.post(f"{appliance.url}/v1/completions", timeout=60,
                              json={"model": "demo", "prompt": "Exceptions", "max_tokens": 48, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.headers["x-appliance-replica"]

    with ThreadPoolExecutor(8) as pool:
        served_by = list(pool.map(one, range(16)))
    assert set(served_by) == {"replica-0", "replica-1"}


def test_the_request_record_names_the_filter_that_kept_a_drained_replica_out(appliance):
    """The question on-call asks ("why did this request go there?"), answered by the record of one request sent
    while replica-0 is drained: the ready filter removed it, replica-1 took it, the answer names both."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.post(f"{appliance.url}/admin/replicas/replica-0/drain", headers=admin, timeout=30).status_code == 200
    try:
        response = httpx.post(f"{appliance.url}/v1/completions", timeout=60,
                              headers={"x-request-id": "drained-filter-check"},
                              json={"model": "demo", "prompt": "Exceptions", "max_tokens": 4})
    finally:
        httpx.post(f"{appliance.url}/admin/replicas/replica-0/undrain", headers=admin, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-appliance-replica"] == "replica-1"
    assert response.headers["x-appliance-request-id"] == "drained-filter-check"
    record = httpx.get(f"{appliance.url}/admin/requests/drained-filter-check", headers=admin, timeout=30).json()
    decision = record["attempts"][0]["decision"]
    assert decision["removed"] == {"replica-0": "ready"}, decision
    assert decision["picked"] == "replica-1" and decision["candidates"] == ["replica-0", "replica-1"]
    assert record["status"] == 200 and record["ttft_seconds"] is not None and record["e2e_seconds"] > 0


def test_killed_engine_is_restarted_while_the_appliance_keeps_answering(appliance):
    victim = appliance.vllm_server_pid(0)
    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal answered
        while not stop.is_set():
            response = httpx.post(f"{appliance.url}/v1/completions", timeout=60,
                                  json={"model": "demo", "prompt": "Lists", "max_tokens": 8})
            if response.status_code == 200:
                answered += 1
            else:
                failures.append(f"{response.status_code} {response.text[:200]}")

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    time.sleep(2)
    import os

    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while appliance.ready_replicas() != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # keep the load on while only replica-1 serves
    stop.set()
    for worker in workers:
        worker.join()
    assert not failures, failures
    assert answered > 0
    appliance.wait_ready(timeout=300)  # the supervisor restarted replica-0
    assert appliance.vllm_server_pid(0) != victim
    assert "replica-0: engine exited with 137" in appliance.log_tail(400)


def test_sigterm_drains_a_long_stream_then_exits_0(appliance):
    """Last in this module: it stops the shared appliance.

    The stream must outlast the checks made during the drain. 1000 tokens last about 3 s, and on a loaded 2-core
    machine the checks once took 3.14 s (the gateway had shut down by then: connection reset). So the engines'
    API servers are paused (SIGSTOP) from the first chunk until the checks are done: the stream is in flight for
    as long as the checks take, however slow the machine, and then runs to its end."""
    body = {"model": "demo", "prompt": "The import system", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    monitors = appliance.monitoring_processes()  # `appliance up`'s Prometheus and Alertmanager, when installed
    servers = [psutil.Process(appliance.vllm_server_pid(i)) for i in range(appliance.replicas)]
    with httpx.stream("POST", f"{appliance.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(lines))
        with paused(*servers):
            signalled = time.monotonic()
            appliance.proc.send_signal(signal.SIGTERM)
            try:  # a draining gateway keeps listening: it answers 503, it does not refuse connections
                ready = httpx.get(f"{appliance.url}/health/ready", timeout=5)
                while ready.status_code == 200 and time.monotonic() - signalled < 10:  # until the signal is handled
                    ready = httpx.get(f"{appliance.url}/health/ready", timeout=5)
                refused = httpx.post(f"{appliance.url}/v1/completions", json={"prompt": "x"}, timeout=5)
            except httpx.TransportError as exc:
                pytest.fail(f"{exc!r} {time.monotonic() - signalled:.2f}s after SIGTERM; gateway exit code "
                            f"{appliance.proc.poll()}; stream so far: {events}")
        checked = time.monotonic() - signalled
        events.extend(line for line in lines if line)
        streamed = time.monotonic() - signalled
    assert checked < streamed, f"the checks ({checked:.2f}s) ran after the stream ended ({streamed:.2f}s)"
    assert ready.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # ran to max_tokens, not cut short
    assert appliance.proc.wait(timeout=120) == 0
    time.sleep(1)
    assert appliance.leftover_engine_processes() == []
    assert [p.pid for p in monitors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
