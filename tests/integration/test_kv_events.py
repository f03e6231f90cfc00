"""Precise prefix routing on real vLLM engines (the shared appliance: 2 CPU replicas publishing their KV-cache
events, the gateway in precise-with-fallback).

After a prompt is served, the replica that served it holds every full block of it in the gateway's event index:
shown by the repeat's routing decision, whose precise score for that replica is exactly those blocks' tokens over
the prompt's tokens as the gateway's own tokenizer counts them. The index only holds hashes the engine reported,
so that equality also says the gateway tokenized and hashed the prompt as vLLM did (chat template and cache salt
included). The repeat goes there, decided by the precise score.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from appliance.gateway.routing.kv_events.tokens import PromptTokenizer, token_job
from tests.integration.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.engine

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def samples(url: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``replica`` (or ``source``) label."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            label = line.split('"')[1]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def tokenizer_loaded(url: str) -> bool:
    """The gateway has loaded the model's tokenizer (in the background from its start): until then a prompt is
    routed without its tokens."""
    return "appliance_routing_tokenizer_loaded 1.0" in httpx.get(f"{url}/metrics", timeout=30).text


def decision(url: str, request_id: str) -> dict:
    record = httpx.get(f"{url}/admin/requests/{request_id}", headers=ADMIN, timeout=30).json()
    return record["attempts"][-1]["decision"] | {"replica": record["replica"]}


def block_size(appliance) -> int:
    """The engines' KV-cache block size, from vLLM's own cache_config_info (128 on vLLM 0.32's CPU build)."""
    text = httpx.get(f"http://127.0.0.1:{appliance.engine_port(0)}/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    return int(line.split('block_size="', 1)[1].split('"', 1)[0])


def ask(url: str, path: str, body: dict, request_id: str) -> None:
    response = httpx.post(f"{url}{path}", json=body, headers={"x-request-id": request_id}, timeout=120)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def tokenizer(demo_model_int8: Path):
    tokenizer = PromptTokenizer(demo_model_int8, threads=1)
    yield tokenizer
    tokenizer.close()


@pytest.mark.parametrize(("route", "salt"), [("chat", None), ("completions", None), ("completions", "tenant-salt")])
def test_the_served_prompts_blocks_are_indexed_and_its_repeat_goes_there(appliance, tokenizer, route: str,
                                                                         salt: str | None):
    url = appliance.url
    wait_for(lambda: samples(url, "appliance_routing_kv_index_usable") == {"replica-0": 1.0, "replica-1": 1.0},
             60, "both replicas' event indexes in step")
    wait_for(lambda: tokenizer_loaded(url), 120, "the gateway's tokenizer")
    size = block_size(appliance)
    topic = f"Conversation {uuid.uuid4().hex}: the for statement, the while statement and the with statement. "
    if route == "chat":
        path = "/v1/chat/completions"
        body = {"model": "demo", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "system", "content": topic * 12}, {"role": "user", "content": "Explain."}]}
    else:
        path = "/v1/completions"
        body = {"model": "demo", "max_tokens": 1, "temperature": 0, "prompt": topic * 12}
    if salt is not None:
        body["cache_salt"] = salt  # the engine hashes the first block with it, and so must the gateway
    prompt = tokenizer.tokenize(token_job(route, body))
    held = len(prompt) // size * size
    assert held >= 3 * size and len(prompt) < 1000, len(prompt)  # several blocks, within max_model_len
    precise_before = samples(url, "appliance_routing_prefix_source_total").get("precise", 0.0)
    blocks_before = samples(url, "appliance_routing_kv_index_blocks")

    first = f"kv-{route}-{uuid.uuid4().hex[:8]}"
    ask(url, path, body, first)
    served = decision(url, first)["replica"]
    other = "replica-1" if served == "replica-0" else "replica-0"
    # The events travel apart from the answer (the engine publishes each step's batch from a thread of its own):
    # the last chunk's blocks may reach the gateway a moment after the answer does.
    wait_for(lambda: samples(url, "appliance_routing_kv_index_blocks")[served]
             >= blocks_before.get(served, 0.0) + held // size, 10, f"{served}'s index to hold the prompt")

    repeat = f"kv-{route}-{uuid.uuid4().hex[:8]}"
    ask(url, path, body, repeat)
    again = decision(url, repeat)
    scores = again["scores"]
    print(f"{route}: {len(prompt)} tokens, served by {served}; the repeat's decision: {again}")
    assert scores[served]["prefix"] == 1.0  # all a prompt could reuse: its full blocks, as vLLM hashed them
    assert scores[other]["prefix"] == 0.0  # never sent there: nothing of it in that engine's cache
    assert again["replica"] == served and again["decided_by"] == "prefix"
    assert samples(url, "appliance_routing_prefix_source_total")["precise"] >= precise_before + 2
    assert samples(url, "appliance_routing_kv_index_blocks")[served] >= held // size
