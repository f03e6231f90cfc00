"""The gateway's own logic against fake engines (tests/fake_engine.py): pass-through, streaming relay, retry rule,
routing."""

import json
import threading

import aiohttp
import httpx
import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.routing.router import Outcome
from appliance.settings import Settings
from tests.fake_engine import Failure


def test_body_passes_through_byte_for_byte(client, stubs):
    raw = b'{"model": "demo", "prompt": "hi",   "max_tokens": 3, "vendor_field": {"x": 1}}'
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "hello"
    received = [r for stub in stubs for r in stub.received]
    assert [r.raw for r in received] == [raw]


def test_stream_is_relayed_chunk_by_chunk(client):
    with client.stream("POST", "/v1/completions",
                       json={"model": "demo", "prompt": "hi", "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["0", "1", "2"]
    replica = response.headers["x-appliance-replica"]
    # Hung-replica detection counts relayed bytes as progress (appliance/maintenance/progress.py).
    assert context_of(client.app).gateway.router.relayed_at(replica) is not None


def test_trace_context_is_forwarded_and_authorization_is_not(make_client, stubs):
    client = make_client(api_keys=["secret"])
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    response = client.post("/v1/completions", json={"prompt": "hi"},
                           headers={"authorization": "Bearer secret", "traceparent": traceparent})
    assert response.status_code == 200
    headers = [r.headers for stub in stubs for r in stub.received][0]
    # Same trace, and the engine's parent is the gateway's upstream span, not the client's.
    assert headers["traceparent"].split("-")[1] == traceparent.split("-")[1]
    assert headers["traceparent"].split("-")[2] != traceparent.split("-")[2]
    assert "Authorization" not in headers


def test_upstream_errors_pass_through_with_their_status(client, stubs):
    for stub in stubs:
        stub.fail_status, stub.fail_message = 400, "stub failure"
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "stub failure"


def test_unreachable_replica_is_retried_on_another(client, stubs, replicas):
    stubs[0].stop()  # replica-0 refuses connections: nothing was sent to the client yet
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 200
    assert response.headers["x-appliance-replica"] == "replica-1"
    assert all(context_of(client.app).gateway.router.in_flight(r.name) == 0 for r in replicas)


def test_all_replicas_unreachable_is_a_502(client, stubs):
    for stub in stubs:
        stub.stop()
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"


def test_no_ready_replica_is_a_503_with_retry_after(client, replicas):
    for replica in replicas:
        replica.routable = False
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503
    assert "retry-after" in response.headers
    assert client.get("/health/ready").status_code == 503
    assert client.get("/health/live").status_code == 200


def test_least_outstanding_replica_wins(client, replicas):
    gateway = context_of(client.app).gateway
    router = gateway.router
    held = [gateway.admission.try_lease(frozenset({"replica-1"}), None) for _ in range(3)]  # at replica-0
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.headers["x-appliance-replica"] == "replica-1"
    assert router.in_flight("replica-0") == 3 and router.in_flight("replica-1") == 0
    for lease in held:
        lease.release(Outcome.SUCCESS)


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["demo"]


def test_timed_out_request_is_not_sent_to_another_replica(make_client, stubs):
    """A timeout after the request reached an engine means that engine may still be working on it: sending it
    again would double the work and charge two replicas for one slow answer."""
    client = make_client(request_timeout_seconds=0.5)
    for stub in stubs:
        stub.first_token_delay = 3.0
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert sum(len(stub.received) for stub in stubs) == 1


def test_requests_that_outlive_the_request_timeout_do_not_eject_replicas(make_client, stubs):
    """Issue 20: six requests that ran past request_timeout_seconds (their own long max_tokens) ejected both
    replicas and put routing into panic mode. The whole-request timeout measures the request, not the replica."""
    client = make_client(request_timeout_seconds=0.3, routing={"eject_consecutive_failures": 3})
    for stub in stubs:
        stub.first_token_delay = 2.0
    codes = [client.post("/v1/completions", json={"prompt": "hi"}).status_code for _ in range(6)]
    assert codes == [504] * 6
    router = context_of(client.app).gateway.router
    assert [router.health_of(f"replica-{i}").consecutive_failures for i in range(2)] == [0, 0]
    assert not any(router.health_of(f"replica-{i}").ejected for i in range(2)) and not router.panic()
    assert router.in_flight() == 0


def test_stalled_stream_is_cut_after_the_idle_timeout_with_an_error_event(make_client, stubs):
    """A stream whose engine goes silent frees its slot after upstream_idle_timeout_seconds, not after the whole
    request_timeout_seconds, and the client learns why from an error event."""
    client = make_client(upstream_idle_timeout_seconds=0.5)
    for stub in stubs:
        stub.stall_seconds = 8.0  # silent after the first token
        stub.token_ids = False  # and without token ids: the stream cannot be continued elsewhere
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 2 and json.loads(events[0][6:])["choices"][0]["text"] == "0"
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_timeout"
    assert context_of(client.app).gateway.router.in_flight() == 0


def test_a_retry_waits_for_a_replica_that_is_only_ejected(make_client, stubs, replicas):
    """The engine a request went to dies before its first byte while the only other replica sits out an ejection
    (a TTFT outlier a moment earlier, as the stream-migration test on real vLLM met): the retry waits for that
    replica, up to the queue timeout, instead of answering 502 at once."""
    client = make_client(routing={"eject_consecutive_failures": 100})
    router = context_of(client.app).gateway.router
    router.eject("replica-1", "a TTFT outlier, for the test")
    stubs[0].stop()  # replica-0 refuses connections
    back = threading.Timer(0.5, router.probe_result, args=("replica-1", True))
    back.start()
    try:
        response = client.post("/v1/completions", json={"prompt": "hi"})
    finally:
        back.cancel()
    assert response.status_code == 200, response.text
    assert response.headers["x-appliance-replica"] == "replica-1"
    assert all(router.in_flight(r.name) == 0 for r in replicas)


def test_the_upstream_connect_timeout_is_the_setting():
    """gateway.upstream_connect_timeout_seconds bounds opening a connection to an engine, for streams and whole
    answers alike (it was a constant 5 s)."""
    app = create_app(Settings(served_model_name="demo", gateway={"upstream_connect_timeout_seconds": 12.5}),
                     replicas=lambda: [], registry=CollectorRegistry())
    upstream = context_of(app).gateway.upstream
    assert upstream._timeout.sock_connect == upstream._stream_timeout.sock_connect == 12.5


@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_dropped_unanswered_is_tried_again_on_the_same_replica(make_client, stubs, replicas, stream):
    """A connection that drops without an answer (a pooled keep-alive connection the engine had just closed) is not
    the replica's fault: tried once more there, even when no other replica could take the request. A CI run saw a
    request get 502 that way while the only other replica restarted."""
    replicas[1].routable = False  # the other replica is restarting
    stubs[0].failures.append(Failure(after=0, how="refuse"))
    client = make_client()
    response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    assert response.status_code == 200, response.text
    assert response.headers["x-appliance-replica"] == "replica-0"
    assert len(stubs[0].received) == 2


def test_a_replica_that_keeps_dropping_connections_gets_one_more_try_only(make_client, stubs, replicas):
    """The one more try is per replica and request: a replica that drops every connection still fails it."""
    replicas[1].routable = False
    stubs[0].failures.extend(Failure(after=0, how="refuse") for _ in range(10))
    client = make_client()
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 502, response.text
    assert len(stubs[0].received) == 2


def failing_connects(client, count: int) -> list[str]:
    """The client's gateway's first ``count`` connections to an engine time out, as aiohttp reports one (what a
    gateway whose loop runs late past its connect deadline on a busy host meets); the replicas it went to."""
    upstream = context_of(client.app).gateway.upstream
    post, tried = upstream.post, []

    async def post_late(exchange, path, body):
        tried.append(exchange.replica.name)
        if len(tried) <= count:
            raise aiohttp.ConnectionTimeoutError("Connection timeout to host")
        return await post(exchange, path, body)

    upstream.post = post_late
    return tried


@pytest.mark.parametrize("stream", [False, True])
def test_a_connect_timeout_on_the_only_replica_is_tried_again_there(make_client, replicas, stream):
    replicas[1].routable = False  # the other replica is restarting
    client = make_client()
    tried = failing_connects(client, 1)
    response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    assert response.status_code == 200, response.text
    assert tried == ["replica-0", "replica-0"]
    assert context_of(client.app).gateway.router.in_flight() == 0


def test_a_connect_timeout_goes_to_another_replica_where_there_is_one(make_client):
    client = make_client()
    tried = failing_connects(client, 1)
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert len(tried) == 2 and tried[0] != tried[1]


def test_a_replica_whose_connects_keep_timing_out_gets_one_more_try_only(make_client, replicas):
    replicas[1].routable = False
    client = make_client()
    tried = failing_connects(client, 10)
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error", response.text
    assert tried == ["replica-0", "replica-0"]


def test_every_request_to_an_engine_carries_the_engine_key_and_the_engines_refuse_others(make_client, stubs):
    """Engines answer the gateway only (vLLM's VLLM_API_KEY): the gateway sends its engine key on every request,
    streamed or not, in place of the client's API key; without it the engine's 401 is all a caller gets."""
    for stub in stubs:
        stub.api_key = "engine-k3y"
    client = make_client(api_keys=["client-key"], gateway={"engine_key": "engine-k3y"})
    auth = {"authorization": "Bearer client-key"}
    assert client.post("/v1/completions", json={"prompt": "hi"}, headers=auth).status_code == 200
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}, headers=auth) as response:
        assert response.status_code == 200 and list(response.iter_lines())[-2] == "data: [DONE]"
    sent = [r.headers for stub in stubs for r in stub.received]
    assert len(sent) == 2 and all(h["Authorization"] == "Bearer engine-k3y" for h in sent)
    direct = httpx.post(f"{stubs[0].url}/v1/completions", json={"model": "demo", "prompt": "hi"})
    assert direct.status_code == 401 and direct.json() == {"error": "Unauthorized"}
    without = make_client(api_keys=["client-key"]).post("/v1/completions", json={"prompt": "hi"}, headers=auth)
    assert without.status_code == 401 and sum(stub.refused for stub in stubs) >= 2
