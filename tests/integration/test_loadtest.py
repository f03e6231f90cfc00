"""`appliance bench` and `appliance capacity` against a real engine of the shared appliance."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine


# What a client adds to the engine's own timings at most, on a loaded 2-core machine.
CLIENT_OVERHEAD_S = 0.25
# A bench whose client was starved refuses to report; it is re-run this many times in all before the test fails.
BENCH_ATTEMPTS = 3


def engine_histogram(url: str, name: str) -> tuple[list[tuple[float, float]], float]:
    """(upper bound, cumulative count) buckets and the count of one vLLM histogram, summed over label sets."""
    buckets: dict[float, float] = {}
    count = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return sorted(buckets.items()), count


def delta(after, before):
    old = dict(before[0])
    return [(le, value - old.get(le, 0.0)) for le, value in after[0]], after[1] - before[1]


def bucket_of_quantile(buckets: list[tuple[float, float]], total: float, q: float) -> tuple[float, float]:
    """The (lower, upper) bounds of the bucket holding the q-quantile."""
    lower = 0.0
    for le, cumulative in buckets:
        if cumulative >= q * total:
            return lower, le
        lower = le
    return lower, float("inf")


def appliance_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_counts_and_percentiles_agree_with_the_engines_histograms(appliance, demo_model_int8, tmp_path):
    engine = f"http://127.0.0.1:{appliance.engine_port(0)}"
    names = ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds")
    invalid: list[str] = []
    for attempt in range(BENCH_ATTEMPTS):
        out = tmp_path / f"attempt-{attempt}"
        before = {n: engine_histogram(engine, n) for n in names}
        result = appliance_cli("bench", "--url", engine, "--api-key", appliance.engine_key(), "--model", "demo",
                               "--concurrency", "4", "--requests",
                               "40", "--warmup", "0", "--prompt-tokens", "32", "--max-tokens", "16", "--tokenizer",
                               str(demo_model_int8), "--no-progress", "--out", str(out),
                               # The engines busy both cores of a CI machine: tolerate the client being scheduled
                               # late (the comparison below is at bucket resolution anyway).
                               "--max-lag-ms", "1000")
        assert (out / "bench.json").exists(), result.stdout + result.stderr  # a bench that wrote nothing says why
        report = json.loads((out / "bench.json").read_text())
        if report["valid"]:
            break
        # The bench refused to report: its client was starved (a verdict about the client, not the engine).
        invalid.append(report["invalid_reason"])
    assert result.returncode == 0, (invalid, result.stdout + result.stderr)
    assert report["valid"] and report["summary"]["requests"] == report["summary"]["succeeded"] == 40
    for name, key in zip(names, ("e2e", "ttft"), strict=True):
        buckets, count = delta(engine_histogram(engine, name), before[name])
        # Every request the bench measured; at most `concurrency` more from its cool-down (load is held until the
        # last measured request ends, and those extra requests are excluded from the report).
        assert 40 <= count <= 40 + 4
        lower, upper = bucket_of_quantile(buckets, count, 0.5)
        p50 = report["summary"]["latency_s"][key]["p50"]
        # The client sees the engine's time plus what the engine does not time: HTTP, tokenisation and the API
        # server's event loop, which on a 2-core CI machine shares a core with a busy engine (seen: +0.13 s on TTFT).
        assert lower - 0.005 <= p50 <= upper + CLIENT_OVERHEAD_S, (name, p50, lower, upper)
    assert (out / "bench.md").exists() and (out / "bench.png").exists()


def test_capacity_search_finds_a_concurrency_on_the_demo_model(appliance, demo_model_int8, tmp_path):
    engine = f"http://127.0.0.1:{appliance.engine_port(1)}"
    result = appliance_cli("capacity", "--url", engine, "--api-key", appliance.engine_key(), "--model", "demo",
                           "--slo-ttft-p95-ms", "2000",
                           "--max-concurrency", "16", "--requests-per-probe", "30", "--max-requests-per-probe", "60",
                           "--settle-s", "0.5", "--prompt-tokens", "32", "--max-tokens", "16", "--tokenizer",
                           str(demo_model_int8), "--no-progress", "--out", str(tmp_path),
                           # As in the bench test: a busy 2-core machine schedules the client late now and then
                           # (CI saw a P99 loop lag of 561 ms); the SLO here (2 s) is far above such lags, and a
                           # batch the client could not drive anyway is re-run (--client-retries).
                           "--max-lag-ms", "1000")
    assert (tmp_path / "capacity.json").exists(), result.stdout + result.stderr
    report = json.loads((tmp_path / "capacity.json").read_text())
    found = report["result"]["max_concurrency"]
    assert result.returncode == (0 if report["result"]["verdict"] in ("met", "capped") else 1), result.stderr
    probes = [(p["concurrency"], p["stage"], p["verdict"], p["reason"]) for p in report["probes"]]
    assert report["result"]["verdict"] in ("met", "capped"), (report["result"], probes)
    assert 1 <= found <= 16
    passing = [p["concurrency"] for p in report["probes"] if p["verdict"] == "pass"]
    assert found in passing  # the answer is a concurrency that was measured to meet the SLA
    assert str(found) in (tmp_path / "capacity.md").read_text()
    assert (tmp_path / "capacity.png").stat().st_size > 0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) >= 30
