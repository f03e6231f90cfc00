"""Clients that hang up stop their work on a real vLLM engine: non-streaming requests whose clients leave after
0.5 s stop generating (vLLM's generation-token counter stops far short of max_tokens, and none finishes with
finished_reason "length"), and the gateway counts them as 499, not 200.

Judged by vLLM's counters, never by vllm:num_requests_running (that gauge can stay 0 on these 2-core machines
while a request runs). Not by finished_reason="abort" either: vLLM 0.32 does not count client aborts there
(AsyncLLM.abort drops the request's state without recording a finish; measured: 0 after 4 aborts). Measured
without the fix (main's gateway on the same engine): the engine generated all 4 x 1,000 tokens and the gateway
counted 4 x 200; with it: 61 tokens in all, 4 x 499.

The engine's model work (vLLM's EngineCore) is paused from before the requests until the gateway has counted all
four clients gone, so the engine cannot race ahead of the disconnect: on a loaded 2-core machine an unpaused engine
generated 1,967 tokens before the aborts landed (CI). Paused, what the engine generates after it resumes is exactly
what nobody stopped: 4 x 1,000 tokens without the fix, 0 with it (measured). The API server and the gateway keep
running, so the disconnect travels the real path: client -> gateway -> closed upstream connection -> vLLM abort.

Slots: bursts of streaming clients that all drop at once, and `appliance capacity` through the gateway
(which stops a probe with requests still running), leave nothing counted in flight: the gateway's count returns
to 0, no slot needed the garbage-collection backstop, and a new request is answered. Before the fix the first
burst left the replica's whole limit counted in flight for good (every later request: 429 after the queue wait).

Its own one-replica appliance (`serve`), so that its aborts do not disturb the shared appliance's measurements.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ApplianceProcess, serving
from tests.processes import paused

pytestmark = pytest.mark.engine

CLIENTS = 4
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def single(demo_model_int8, tmp_path_factory):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("disconnect"), replicas=1)
    with serving(app) as running:
        yield running


def sample_sum(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def finished(app: ApplianceProcess, reason: str) -> float:
    return sample_sum(f"http://127.0.0.1:{app.engine_port(0)}/metrics", "vllm:request_success_total",
                      finished_reason=reason)


def gateway_count(app: ApplianceProcess, code: str) -> float:
    return sample_sum(f"{app.url}/metrics", "appliance_requests_total", route="completions", code=code)


def post_and_hang_up(app: ApplianceProcess, after_seconds: float) -> None:
    body = json.dumps({"model": "demo", "prompt": "The class statement", "max_tokens": MAX_TOKENS,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", app.port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(after_seconds)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def generated(app: ApplianceProcess) -> float:
    return sample_sum(f"http://127.0.0.1:{app.engine_port(0)}/metrics", "vllm:generation_tokens_total")


def settled(read, quiet_seconds: float = 3.0, timeout: float = 90.0) -> float:
    """The value of a counter once it stops moving (vLLM's counters can lag behind its work on a busy host)."""
    deadline = time.monotonic() + timeout
    last = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_seconds)
        now = read()
        if now == last:
            return now
        last = now
    return last


def test_non_streaming_clients_that_leave_stop_their_engine_requests(single):
    tokens, lengths, gone = generated(single), finished(single, "length"), gateway_count(single, "499")
    with paused(*single.engine_core_processes(0)):
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(lambda _: post_and_hang_up(single, 0.5), range(CLIENTS)))
        assert wait_for(lambda: gateway_count(single, "499") - gone == CLIENTS, timeout=30)
    spent = settled(lambda: generated(single)) - tokens
    # Each request asked for 1,000 tokens; aborted before the engine resumed, they make a few at most.
    assert spent < CLIENTS * MAX_TOKENS / 4, f"the engine generated {spent} tokens for clients that had left"
    assert finished(single, "length") == lengths  # none ran to max_tokens for nobody
    assert gateway_count(single, "200") == 0


def gateway_gauge(app: ApplianceProcess, name: str) -> float:
    return sample_sum(f"{app.url}/metrics", name)


def back_to_baseline(app: ApplianceProcess) -> bool:
    return gateway_gauge(app, "appliance_inflight_requests") == 0 and gateway_gauge(app, "appliance_queue_length") == 0


def answered(app: ApplianceProcess) -> int:
    response = httpx.post(f"{app.url}/v1/completions", timeout=120,
                          json={"model": "demo", "prompt": "The class statement", "max_tokens": 4})
    return response.status_code


def burst_of_streams_dropped_at_once(app: ApplianceProcess, clients: int, rng: random.Random) -> None:
    body = json.dumps({"model": "demo", "prompt": "The class statement", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    sockets = []
    try:
        for _ in range(clients):
            sock = socket.create_connection(("127.0.0.1", app.port))
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            sockets.append(sock)
        time.sleep(rng.uniform(1.0, 3.0))  # some stream, the rest wait in the gateway's queue
    finally:
        for sock in sockets:
            sock.close()


def test_bursts_of_streams_dropped_at_once_give_every_slot_back(single):
    rng = random.Random(20)
    for _ in range(3):
        burst_of_streams_dropped_at_once(single, 128, rng)
    assert wait_for(lambda: back_to_baseline(single), timeout=60), (
        gateway_gauge(single, "appliance_inflight_requests"), gateway_gauge(single, "appliance_queue_length"))
    assert gateway_gauge(single, "appliance_slot_leases_reclaimed_total") == 0
    assert gateway_gauge(single, "appliance_slot_orphans_returned_total") == 0
    assert answered(single) == 200


def test_a_capacity_search_through_the_gateway_reports_and_leaves_it_serving(single, demo_model_int8, tmp_path):
    """The issue's reproduction: `appliance capacity` against one real replica through the gateway; its probes
    stop with requests still running, which wedged the gateway before the fix."""
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "capacity", "--url", single.url, "--model", "demo",
         "--slo-ttft-p95-ms", "3000", "--max-concurrency", "64", "--requests-per-probe", "32",
         "--max-requests-per-probe", "80", "--settle-s", "0.5", "--prompt-tokens", "16", "--max-tokens", "8",
         "--tokenizer", str(demo_model_int8), "--no-progress", "--out", str(tmp_path), "--max-lag-ms", "1000"],
        capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "capacity.json").read_text())
    assert report["result"]["max_concurrency"] is not None and report["result"]["max_concurrency"] >= 1, (
        report["result"], result.stderr[-2000:])
    assert wait_for(lambda: back_to_baseline(single), timeout=60)
    assert gateway_gauge(single, "appliance_slot_leases_reclaimed_total") == 0
    assert answered(single) == 200
