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

Its own one-replica appliance (`serve`), so that its aborts do not disturb the shared appliance's measurements.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ApplianceProcess
from tests.processes import paused

pytestmark = pytest.mark.engine

CLIENTS = 4
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def single(demo_model_int8, tmp_path_factory):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("disconnect"), replicas=1)
    app.start()
    try:
        app.wait_ready(timeout=400)
        yield app
    finally:
        app.stop()


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
