"""The capacity search against a stub whose latency jumps past a known concurrency, and the soak's windows and
drift verdicts (memory growing in the stub's /metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from appliance.loadtest.bench import SLO, Target
from appliance.loadtest.capacity import CapacityConfig, CapacityRun, CapacitySearch, run_capacity, soak_windows
from appliance.loadtest.client import RequestResult
from appliance.loadtest.load import LoadRun
from appliance.loadtest.metrics_scrape import Reading, read
from appliance.loadtest.prompts import SyntheticPrompts, WordCounter
from tests.fake_engine import FakeEngine
from tests.loadtest.timing import retry_if_starved

Start = Callable[..., FakeEngine]
KNEE = 5


def _config(stub: FakeEngine, **kw: object) -> CapacityConfig:
    # Wide margins between fast (a few ms), the SLO and slow: the test machine is shared and busy.
    base: dict[str, object] = dict(target=Target(stub.url, "stub"), slo=SLO(ttft_s=0.25), max_concurrency=32,
                                   requests_per_probe=60, max_requests_per_probe=120, max_lag_s=0.5, settle_s=0.2)
    base.update(kw)
    return CapacityConfig(**base)  # type: ignore[arg-type]


def _prompts() -> SyntheticPrompts:
    return SyntheticPrompts(WordCounter(), 16, 0, 2)


def test_search_finds_the_knee(stub_server: Start) -> None:
    """TTFT is 4 ms while at most KNEE requests are in flight and 500 ms beyond: the answer is KNEE."""
    stub = stub_server(first_token_delay=lambda inflight: 0.004 if inflight <= KNEE else 0.5, token_delay=0.001)
    retry_if_starved(lambda: _check_knee(asyncio.run(run_capacity(_config(stub), _prompts()))))


def _check_knee(run: CapacityRun) -> None:
    assert run.result["verdict"] == "met", run.result
    assert run.result["max_concurrency"] == KNEE and run.result["upper_bound"] == KNEE + 1
    probed = [(p.concurrency, p.stage, p.verdict) for p in run.probes]
    assert probed[:4] == [(1, "feasibility", "pass"), (2, "doubling", "pass"), (4, "doubling", "pass"),
                          (8, "doubling", "fail")]
    assert probed[-1] == (KNEE, "confirm", "pass")
    for p in run.probes:
        assert "ttft P95" in p.reason
        if p.verdict == "pass":
            assert p.summary["sla"]["decisions"]["ttft"]["n"] >= 60
        else:  # failing probes stop as soon as the rest cannot change the verdict
            assert p.verdict == "fail" and p.summary["early_stop"].startswith("stopped after")
            assert "unresolved" not in p.reason and "fewer than the minimum" not in p.reason, p.reason
    assert run.exit_code == 0
    assert {row["probe"] for row in run.rows} == {p.id for p in run.probes}


def test_unreachable_at_concurrency_one(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.025, token_delay=0.0)
    run = asyncio.run(run_capacity(_config(stub, slo=SLO(ttft_s=0.01), requests_per_probe=40,
                                           max_requests_per_probe=40), _prompts()))
    assert run.result["verdict"] == "unreachable" and run.result["max_concurrency"] is None
    assert [p.concurrency for p in run.probes] == [1]
    assert run.exit_code == 1


def test_capped_by_max_concurrency(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.003, token_delay=0.0)
    retry_if_starved(lambda: _check_capped(asyncio.run(run_capacity(_config(stub, max_concurrency=4), _prompts()))))


def _check_capped(run: CapacityRun) -> None:
    assert run.result["verdict"] == "capped" and run.result["max_concurrency"] == 4
    assert [p.concurrency for p in run.probes] == [1, 2, 4, 4]
    assert run.exit_code == 0


def test_unresolved_probe_is_extended(stub_server: Start) -> None:
    """1 in 15 requests misses the SLO: 30 requests cannot decide 95%, so the probe grows toward the cap."""
    calls = {"n": 0}

    def ttft(_inflight: int) -> float:
        calls["n"] += 1
        return 0.4 if calls["n"] % 15 == 0 else 0.003

    stub = stub_server(first_token_delay=ttft, token_delay=0.0)

    def check() -> None:
        search = CapacitySearch(_config(stub, requests_per_probe=30, max_requests_per_probe=90), _prompts())
        probe = asyncio.run(search.probe(1, "feasibility"))
        assert probe.batches >= 2 and probe.summary["requests"] >= 60, probe.reason
        assert probe.verdict in ("unresolved", "fail")  # a true 93% is never shown to meet 95%

    retry_if_starved(check)


def _client_stalls(monkeypatch: pytest.MonkeyPatch, stalls: int | None) -> None:
    """Make the first ``stalls`` load runs (all of them if None) report a client bottleneck, as a CPU-starved
    client on a busy host does."""
    stalled: list[LoadRun] = []  # held, so a later run cannot reuse a stalled one's identity

    def bottleneck(run: LoadRun) -> str | None:
        seen = any(r is run for r in stalled)
        if not seen and (stalls is None or len(stalled) < stalls):
            stalled.append(run)
            seen = True
        if seen:
            return "the client's event loop stalled: P99 loop lag 560.8 ms > 500.0 ms"
        return None

    monkeypatch.setattr(LoadRun, "client_bottleneck", bottleneck)


def test_a_batch_the_client_could_not_drive_is_discarded_and_rerun(stub_server: Start,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One stall of the client must not count as the server failing the SLA (it ended a CI search as
    "unstable"): the batch is re-run, and its requests stay in requests.jsonl marked as discarded."""
    _client_stalls(monkeypatch, stalls=1)
    stub = stub_server(first_token_delay=0.003, token_delay=0.0)
    search = CapacitySearch(_config(stub), _prompts())
    probe = asyncio.run(search.probe(1, "feasibility"))
    assert probe.verdict == "pass", probe.reason
    assert len(probe.discarded) == 1 and "loop lag" in probe.discarded[0] and probe.batches >= 2
    assert "1 batch(es) discarded first" in probe.reason
    discarded = [row for row in search.run.rows if row.get("discarded")]
    assert len(discarded) >= 60  # the first batch: 60 measured requests and the warm-up
    # Only the re-run's requests count (the discarded ones are not in the summary).
    assert probe.summary["requests"] == sum(r["phase"] == "measure" for r in search.run.rows) - 60


def test_a_client_that_never_keeps_up_ends_the_search_as_invalid(stub_server: Start,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _client_stalls(monkeypatch, stalls=None)
    stub = stub_server(first_token_delay=0.003, token_delay=0.0)
    run = asyncio.run(run_capacity(_config(stub, requests_per_probe=20, max_requests_per_probe=20,
                                           client_retries=2), _prompts()))
    assert run.result["verdict"] == "invalid" and run.result["max_concurrency"] is None, run.result
    assert "could not drive C=1 in 3 tries" in run.result["reason"] and "--max-lag-ms" in run.result["reason"]
    assert [(p.concurrency, p.verdict, p.batches) for p in run.probes] == [(1, "invalid", 3)]
    assert run.exit_code == 1


def test_soak_detects_memory_growth(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.003, token_delay=0.001, resident_memory_bytes=lambda t: 1e9 * (1 + 0.3 * t))
    config = _config(stub, soak_s=2.0, soak_window_s=0.4, metrics_url=stub.url + "/metrics")
    retry_if_starved(lambda: _check_soak(CapacitySearch(config, _prompts())))


def _check_soak(search: CapacitySearch) -> None:
    search.run.result = {"verdict": "met", "max_concurrency": 2}
    soak = asyncio.run(search.soak(2))
    assert len(soak["windows"]) == 5
    assert soak["drift"]["memory_bytes"]["verdict"] == "drift"
    assert soak["drift"]["kv_usage"]["verdict"] == "stable"
    assert soak["metrics"]["metrics"] == {"memory_bytes": "process_resident_memory_bytes",
                                          "device_memory_bytes": None, "kv_usage": "vllm:kv_cache_usage_perc"}
    assert soak["drift"]["device_memory_bytes"]["verdict"] == "insufficient"  # no such metric on this server
    assert soak["verdict"] == "drift" and search.run.exit_code == 1
    assert all(w["requests"] > 0 and w["memory_bytes"] for w in soak["windows"])


def _result(i: float, ttft: float, end: float) -> RequestResult:
    return RequestResult(index=int(i * 100), phase="measure", intended=i, sent=i, first_token=i + ttft, end=end,
                         chunk_times=[i + ttft], status=200, completion_tokens=4)


def test_soak_windows_on_synthetic_results() -> None:
    results = [_result(0.01 * k, 0.01 * (1 + k // 100), 0.01 * k + 0.05) for k in range(300)]  # TTFT steps up
    readings = [Reading(t=0.5 * k, values={"memory_bytes": 100.0 + k, "kv_usage": 0.5}, metrics={})
                for k in range(6)]
    windows = soak_windows(results, readings, start=0.0, window_s=1.0, duration_s=3.0)
    assert [w["requests"] for w in windows] == [100, 100, 100]
    assert [w["ttft_p95_s"] for w in windows] == pytest.approx([0.01, 0.02, 0.03])
    assert windows[0]["memory_bytes"] == pytest.approx(100.5) and windows[2]["memory_bytes"] == pytest.approx(104.5)
    assert windows[1]["output_tokens_per_s"] == pytest.approx(400)
    partial = soak_windows(results, readings, start=0.0, window_s=1.0, duration_s=2.4)
    assert len(partial) == 2  # a trailing 0.4 s window would read low: dropped


def test_metrics_reading() -> None:
    text = "\n".join([
        "# TYPE process_resident_memory_bytes gauge", "process_resident_memory_bytes 5e8",
        "# TYPE appliance_engine_resident_memory_bytes gauge",
        'appliance_engine_resident_memory_bytes{replica="r0"} 1e9',
        'appliance_engine_resident_memory_bytes{replica="r1"} 2e9',
        "# TYPE appliance_engine_gpu_memory_bytes gauge",
        'appliance_engine_gpu_memory_bytes{replica="r0",gpu="0"} 7e10',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0"} 0.25', 'vllm:kv_cache_usage_perc{engine="1"} 0.75',
        "# TYPE appliance_engine_requests_running gauge", 'appliance_engine_requests_running{replica="r0"} 3', ""])
    reading = read(text, 1.0)
    assert reading.metrics == {"memory_bytes": "appliance_engine_resident_memory_bytes",
                               "device_memory_bytes": "appliance_engine_gpu_memory_bytes",
                               "kv_usage": "vllm:kv_cache_usage_perc"}
    assert reading.values == {"memory_bytes": 3e9, "device_memory_bytes": 7e10, "kv_usage": 0.75}
    explicit = read(text, 1.0, {"memory_bytes": "process_resident_memory_bytes", "kv_usage": "absent"})
    assert explicit.values["memory_bytes"] == 5e8 and explicit.values["kv_usage"] is None


def test_the_metrics_scrape_carries_the_metrics_credential() -> None:
    """An appliance with metrics_token set answers /metrics 401 without it: the soak's scrapes send
    the token they are given, and count a refusal as a failed scrape."""
    from aiohttp import web

    from appliance.loadtest.metrics_scrape import MetricsPoller

    async def metrics(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer m-token":
            return web.Response(status=401)
        return web.Response(text="appliance_engine_kv_cache_usage_ratio 0.25\n")

    async def scrape(token: str | None) -> MetricsPoller:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        poller = MetricsPoller(f"http://127.0.0.1:{port}/metrics", 1.0, lambda: 0.0, token=token)
        try:
            async with aiohttp.ClientSession() as session:
                await poller.scrape_once(session)
        finally:
            await runner.cleanup()
        return poller

    refused = asyncio.run(scrape(None))
    assert (refused.failures, refused.last_error) == (1, "ValueError: HTTP 401")
    allowed = asyncio.run(scrape("m-token"))
    assert allowed.failures == 0 and allowed.readings[0].values["kv_usage"] == 0.25
