"""The gateway's /metrics: request histograms with SLO buckets, fleet state read at scrape time, SD targets."""

from prometheus_client.parser import text_string_to_metric_families

from appliance.context import context_of


def scrape(client) -> dict[str, list]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def value(samples, name, **labels) -> float:
    return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_stream_latency_and_counts_are_recorded(client, stubs):
    for stub in stubs:
        stub.first_token_delay = stub.token_delay = 0.02  # separate chunks in time: inter-token gaps to measure
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as response:
        list(response.iter_lines())
    client.post("/v1/completions", json={"prompt": "hi"})
    client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    families = scrape(client)
    requests = families["appliance_requests"]
    assert value(requests, "appliance_requests_total", route="completions", code="200") == 2
    ttft = families["appliance_request_ttft_seconds"]
    assert value(ttft, "appliance_request_ttft_seconds_count", route="completions") == 1
    assert value(families["appliance_request_itl_seconds"], "appliance_request_itl_seconds_count",
                 route="completions") >= 2


def test_every_answer_on_a_client_route_is_counted_once(make_client, replicas):
    """Rejections the proxy never sees (validation, unknown model, size, drain, full queue) count too: an
    availability SLO computed from appliance_requests_total must see every answer."""
    client = make_client(max_request_bytes=2048, admission={"max_queue": 0, "max_limit": 1})
    client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    client.post("/v1/completions", json={"prompt": "x" * 4096})
    for replica in replicas:
        replica.drain()  # nothing routable and no restart planned: the proxy answers 503 (counted by it, once)
    client.post("/v1/completions", json={"prompt": "hi"})
    context_of(client.app).live.draining = True
    client.post("/v1/completions", json={"prompt": "hi"})
    client.get("/v1/models")  # not a generation route: not counted
    samples = scrape(client)["appliance_requests"]
    counted = {(s.labels["route"], s.labels["code"]): s.value for s in samples if s.name == "appliance_requests_total"}
    assert counted == {("completions", "400"): 1, ("chat", "404"): 1, ("completions", "413"): 1,
                       ("completions", "503"): 2}


def test_ttft_buckets_include_the_slo(make_client):
    client = make_client(slo_ttft_p95_seconds=0.65)
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as response:
        list(response.iter_lines())
    buckets = {s.labels["le"] for s in scrape(client)["appliance_request_ttft_seconds"] if s.name.endswith("bucket")}
    assert "0.65" in buckets


def test_fleet_state_is_exported(client, replicas):
    admission = context_of(client.app).gateway.admission
    held = [admission.try_lease(frozenset({"replica-0"}), None) for _ in range(2)]  # two requests at replica-1
    families = scrape(client)
    assert value(families["appliance_replica_outstanding_requests"], "appliance_replica_outstanding_requests",
                 replica="replica-1") == 2
    assert len(held) == 2  # held until here: a dropped lease would give its slot back
    assert value(families["appliance_queue_length"], "appliance_queue_length") == 0
    assert value(families["appliance_replica_concurrency_limit"], "appliance_replica_concurrency_limit",
                 replica="replica-0") >= 1


def test_sd_targets_list_every_engine(client, stubs):
    groups = client.get("/sd/targets").json()
    assert [g["targets"] for g in groups] == [[f"127.0.0.1:{stub.port}"] for stub in stubs]
    assert groups[0]["labels"] == {"replica": "replica-0", "model": "demo"}
