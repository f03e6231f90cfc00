"""Precise prefix routing through the whole gateway (fake engines, tests/fake_engine.py, for the HTTP side; vLLM's
own publisher for the events): the settings build it, the hub subscribes at the replicas' derived ports, the
request's prompt is tokenized off the event loop before it is routed, and it goes where the events say the prompt
is cached, not where load alone would send it. Requests the gateway cannot tokenize, and prompts that arrive while
no index is current, are routed without waiting for tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.hook import PromptTokensHook
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer, token_job
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.kv_engine import Engine, port_free
from tests.gateway.live import LiveWorkers

CHAT = {"model": "demo", "messages": [{"role": "system", "content": "You answer questions about Python. " * 8},
                                      {"role": "user", "content": "What does a for loop do?"}], "max_tokens": 3}


def offsets_free_for(port: int) -> tuple[int, int]:
    """Port offsets whose ports above ``port`` are free (the fake engines listen on random ports)."""
    for offset in range(1000, 4000, 7):
        if port + 2 * offset < 65536 and port_free(port + offset) and port_free(port + 2 * offset):
            return offset, 2 * offset
    raise RuntimeError("no free offsets")


def wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def tokenizers_loaded(metrics: Callable[[], str], count: int = 1) -> None:
    """Until ``count`` gateway processes have loaded the tokenizer (in the background: importing transformers takes
    tens of seconds on a loaded host, and a request meanwhile is routed without its tokens)."""
    wait(lambda: f"appliance_routing_tokenizer_loaded {float(count)}" in metrics(), timeout=120)


@pytest.fixture
def precise(stubs, demo_model_int8: Path):
    offset, replay_offset = offsets_free_for(stubs[1].port)
    engine = Engine(events_port=stubs[1].port + offset, replay_port=stubs[1].port + replay_offset)
    replicas = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    settings = Settings(served_model_name="demo", engine={"kv_events": "local", "kv_events_port_offset": offset,
                                                          "kv_events_replay_port_offset": replay_offset},
                        routing={"prefix_cache": {"mode": "precise-with-fallback", "tokenizer": demo_model_int8}})
    client = TestClient(create_app(settings, replicas=lambda: replicas), raise_server_exceptions=False)
    client.__enter__()
    try:
        yield client, engine, demo_model_int8
    finally:
        client.__exit__(None, None, None)
        engine.close()


def publish_chat_blocks(engine: Engine, hub: KvEventsHub, model: Path) -> None:
    """replica-1's engine stores CHAT's full blocks (as the model's tokenizer makes them) and says so; returns once
    the gateway's index holds them."""
    from vllm.distributed.kv_events import BlockStored

    tokenizer = PromptTokenizer(model, threads=1)
    try:
        ids = tokenizer.tokenize(token_job("chat", CHAT))
    finally:
        tokenizer.close()
    keys = BlockHasher("random").keys(ids, 16)
    engine.publish(BlockStored(block_hashes=[k.to_bytes(8, "big") for k in keys], parent_block_hash=None,
                               token_ids=ids[:16 * len(keys)], block_size=16, lora_id=None, medium="GPU",
                               lora_name=None))
    wait(lambda: len(hub.indexes["replica-1"]) == len(keys))


def test_a_prompt_goes_where_its_engine_reports_it_cached(precise, stubs):
    client, engine, model = precise
    hub = context_of(client.app).gateway.kv_events
    assert isinstance(hub, KvEventsHub)
    wait(lambda: hub.usable("replica-1") is not None)  # subscribed at replica-1's port + offset, in step
    publish_chat_blocks(engine, hub, model)
    tokenizers_loaded(lambda: client.get("/metrics").text)

    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert len(stubs[1].received) == 1 and not stubs[0].received  # load alone ties, and the tie goes to replica-0
    metrics = client.get("/metrics").text
    assert 'appliance_routing_prefix_source_total{source="precise"} 1.0' in metrics
    assert "appliance_routing_prompts_tokenized_total 1.0" in metrics
    assert 'appliance_routing_kv_index_usable{replica="replica-1"} 1.0' in metrics


def test_with_workers_a_prompt_tokenized_in_a_worker_goes_where_its_engine_reports_it_cached(stubs, demo_model_int8):
    """gateway.workers 2: a worker tokenizes the prompt (the decider's fleet says an index is current), sends the
    ids with its Acquire, and the decider's precise scorer routes on them."""
    offset, replay_offset = offsets_free_for(stubs[1].port)
    engine = Engine(events_port=stubs[1].port + offset, replay_port=stubs[1].port + replay_offset)
    replicas = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    settings = Settings(served_model_name="demo", gateway={"workers": 2},
                        engine={"kv_events": "local", "kv_events_port_offset": offset,
                                "kv_events_replay_port_offset": replay_offset},
                        routing={"prefix_cache": {"mode": "precise-with-fallback", "tokenizer": demo_model_int8}})
    app = create_app(settings, replicas=lambda: replicas, registry=MergedRegistry())
    try:
        with LiveWorkers(app, settings) as live:
            hub = context_of(app).gateway.kv_events
            assert isinstance(hub, KvEventsHub)
            wait(lambda: hub.usable("replica-1") is not None)
            publish_chat_blocks(engine, hub, demo_model_int8)
            pool = live.server._workers
            assert pool is not None
            sent = pool.decider
            wait(lambda: sent._fleet is not None and sent._fleet.kv_usable, timeout=5)  # told to the workers
            with httpx.Client(base_url=live.url, timeout=30) as http:
                # the decider's and both workers' (either worker may take the request), summed
                tokenizers_loaded(lambda: http.get("/metrics").text, count=3)
                response = http.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                assert len(stubs[1].received) == 1 and not stubs[0].received, \
                    [line for line in http.get("/metrics").text.splitlines() if "tokeniz" in line]
                wait(lambda: "appliance_routing_prompts_tokenized_total 1.0" in http.get("/metrics").text)
                assert 'appliance_routing_prefix_source_total{source="precise"} 1.0' in http.get("/metrics").text
    finally:
        engine.close()


def test_what_cannot_be_tokenized_is_routed_at_once(precise, stubs):
    client, engine, _ = precise
    hub = context_of(client.app).gateway.kv_events
    assert hub is not None
    wait(lambda: hub.usable("replica-1") is not None)
    response = client.post("/v1/completions", json={"model": "demo", "prompt": ["one", "two"], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert 'appliance_routing_prompts_untokenized_total{reason="unsupported"} 1.0' in client.get("/metrics").text


def test_a_request_does_not_wait_for_the_tokenizer_to_load(precise, stubs):
    """Until the tokenizer has loaded, a prompt is routed without its tokens, at once, and says why."""
    client, engine, model = precise
    hub = context_of(client.app).gateway.kv_events
    assert isinstance(hub, KvEventsHub)
    wait(lambda: hub.usable("replica-1") is not None)
    publish_chat_blocks(engine, hub, model)
    gateway = context_of(client.app).gateway
    tokenizer = next(h for h in gateway.upstream.hooks if isinstance(h, PromptTokensHook)).tokenizer
    tokenizer.loaded.clear()  # as it is from the start until a thread has loaded it
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert len(stubs[0].received) == 1 and not stubs[1].received  # the tie goes to replica-0: no tokens
    metrics = client.get("/metrics").text
    assert 'appliance_routing_prompts_untokenized_total{reason="loading"} 1.0' in metrics
    assert "appliance_routing_tokenizer_loaded 0.0" in metrics
    assert "appliance_routing_prompts_tokenized_total 0.0" in metrics


def test_approximate_mode_builds_nothing_of_it(stubs):
    replicas = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    settings = Settings(served_model_name="demo", engine={"kv_events": "local"})
    with TestClient(create_app(settings, replicas=lambda: replicas)) as client:
        assert context_of(client.app).gateway.kv_events is None
        assert "appliance_routing_kv_index" not in client.get("/metrics").text


def test_precise_mode_without_events_stays_approximate(stubs, caplog: pytest.LogCaptureFixture):
    replicas = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    settings = Settings(served_model_name="demo", routing={"prefix_cache": {"mode": "precise"}})
    with TestClient(create_app(settings, replicas=lambda: replicas)) as client:
        assert context_of(client.app).gateway.kv_events is None
    assert "no engine publishes KV events" in caplog.text


def test_where_each_replica_publishes():
    """The appliance's own engines: their port plus the offsets, on loopback for local, at their address for network;
    engines found by discovery or listed: only with discovery.kv_events, at their address."""
    from appliance.composition.prefix_cache import event_endpoints

    def at(settings: Settings, url: str) -> tuple[str, str | None] | None:
        endpoints = event_endpoints(settings)
        found = endpoints(FakeReplica("replica-0", url)) if endpoints is not None else None
        return None if found is None else (found.events, found.replay)

    own = {"served_model_name": "demo"}
    assert at(Settings(**own, engine={"kv_events": "local"}), "http://10.0.0.5:8101") == (
        "tcp://127.0.0.1:9101", "tcp://127.0.0.1:10101")
    assert at(Settings(**own, engine={"kv_events": "network"}), "http://10.0.0.5:8101") == (
        "tcp://10.0.0.5:9101", "tcp://10.0.0.5:10101")
    assert at(Settings(**own), "http://127.0.0.1:8101") is None  # events off
    listed = {**own, "discovery": {"engine_urls": ["http://[fd00::7]:8100"]}}
    assert at(Settings(**listed, engine={"kv_events": "local"}), "http://[fd00::7]:8100") is None  # not ours
    assert at(Settings(**{**listed, "discovery": {**listed["discovery"], "kv_events": True}}),
              "http://[fd00::7]:8100") == ("tcp://[fd00::7]:9100", "tcp://[fd00::7]:10100")
    gateway = {**own, "role": "gateway", "discovery": {"name": "engines.test", "kv_events": True}}
    assert at(Settings(**gateway), "http://10.1.2.3:8100") == ("tcp://10.1.2.3:9100", "tcp://10.1.2.3:10100")
