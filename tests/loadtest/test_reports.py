"""Reports: every file written, the Markdown saying what the JSON says, and writes that are atomic."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from appliance.loadtest import report as rep
from appliance.loadtest.bench import SLO, Target, bench_report, summarize_results
from appliance.loadtest.capacity import drift_verdicts, soak_windows
from appliance.loadtest.client import RequestResult
from appliance.loadtest.load import LoadRun, LoadSpec
from appliance.loadtest.metrics_scrape import Reading

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results(n: int = 40, slow_every: int = 10) -> list[RequestResult]:
    out = []
    for k in range(n):
        ttft = 0.2 if k % slow_every == 0 else 0.02 + 0.001 * k
        start = 0.05 * k
        chunks = [start + ttft + 0.01 * j for j in range(8)]
        out.append(RequestResult(index=k, phase="measure" if k >= 2 else "warmup", intended=start,
                                 dispatched=start, sent=start + 0.001, first_token=chunks[0], end=chunks[-1],
                                 chunk_times=chunks, status=200, prompt_tokens=33, completion_tokens=8,
                                 target_prompt_tokens=33, max_tokens=8))
    out.append(RequestResult(index=n, phase="measure", intended=0.05 * n, sent=0.05 * n, end=0.05 * n + 0.1,
                             status=500, error="HTTP 500: boom"))
    return out


def _bench(valid: bool = True) -> tuple[dict[str, Any], list[RequestResult]]:
    results = _results()
    spec = LoadSpec(concurrency=2, requests=len(results) - 2, warmup=2, max_lag_s=0.05 if valid else 1e-9)
    if not valid:
        for r in results:
            r.dispatched = r.intended + 0.5  # the scheduler was half a second late for everything
    run = LoadRun(spec, results, [], measure_start=0.1, elapsed=3.0)
    report = bench_report(Target("http://127.0.0.1:9", "m"), spec, run, SLO(ttft_s=0.1, e2e_s=0.3),
                          {"description": "synthetic"})
    return report, results


def test_bench_files_and_consistency(tmp_path: Path) -> None:
    report, results = _bench()
    files = rep.write_bench_report(tmp_path, report, results)
    assert set(files) == {"requests", "markdown", "json", "plot"}
    for name in files.values():
        assert (tmp_path / name).is_file()
    assert (tmp_path / "bench.png").read_bytes().startswith(PNG_MAGIC)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["files"] == files
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == len(results) and [r["index"] for r in rows] == sorted(r.index for r in results)
    md = (tmp_path / "bench.md").read_text()
    lat = data["summary"]["latency_s"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        s = lat[metric]
        expected = (f"| {metric} | {rep.fmt_ms(s['p50'])} | {rep.fmt_ms(s['p90'])} | {rep.fmt_ms(s['p95'])} "
                    f"| {rep.fmt_ms(s['p99'])} |")
        assert expected in md, expected
    assert f"requests/s: {rep.fmt_num(data['summary']['throughput']['requests_per_s'])}" in md
    assert f"SLA verdict: **{data['summary']['sla']['verdict']}**" in md
    ttft = data["summary"]["sla"]["decisions"]["ttft"]
    assert f"| {ttft['successes']}/{ttft['n']} |" in md
    assert f"verdict: **{data['verdict']}**" in md
    assert not list(tmp_path.glob(".*.tmp"))


def test_bench_summary_numbers() -> None:
    report, results = _bench()
    s = report["summary"]
    measured = [r for r in results if r.phase == "measure"]
    assert s["requests"] == len(measured) and s["succeeded"] == len(measured) - 1
    assert s["errors"]["count"] == 1 and s["errors"]["by_kind"] == {"HTTP 500": 1}
    assert s["tokens"]["prompt_target_match_fraction"] == 1.0
    assert s["tokens"]["completion_at_max_tokens_fraction"] == 1.0
    assert s["latency_s"]["tpot"]["p50"] == pytest.approx(0.01)
    assert s["latency_s"]["queue"]["max"] == pytest.approx(0.001)
    direct = summarize_results(measured, s["window_s"])
    assert direct["latency_s"]["ttft"] == s["latency_s"]["ttft"]


def test_invalid_bench_is_not_reported(tmp_path: Path) -> None:
    report, results = _bench(valid=False)
    assert report["valid"] is False and report["summary"] is None
    files = rep.write_bench_report(tmp_path, report, results)
    assert "plot" not in files and not (tmp_path / "bench.png").exists()
    md = (tmp_path / "bench.md").read_text()
    assert "Not reported" in md and "fell behind" in md
    assert (tmp_path / "requests.jsonl").is_file()  # raw data stays available for diagnosis


def _capacity_report() -> dict[str, Any]:
    results = [r for r in _results() if r.phase == "measure"]
    slo = SLO(ttft_s=0.1)
    probes = []
    for i, (c, stage, verdict) in enumerate([(1, "feasibility", "pass"), (2, "doubling", "pass"),
                                             (4, "doubling", "fail"), (3, "bisection", "pass"),
                                             (3, "confirm", "pass")]):
        summary = summarize_results(results, 2.0, slo)
        probes.append({"id": i, "concurrency": c, "stage": stage, "verdict": verdict, "reason": f"reason {i}",
                       "batches": 1, "summary": summary, "client": {}})
    readings = [Reading(0.1 * k, {"memory_bytes": 1e9 + 1e7 * k, "kv_usage": 0.3}, {}) for k in range(25)]
    windows = soak_windows(results, readings, 0.0, 0.5, 2.0)
    soak = {"concurrency": 3, "duration_s": 2.0, "window_s": 0.5, "verdict": "drift", "invalid_reason": None,
            "sla": None, "drift": {v.series: v.as_dict() for v in drift_verdicts(windows)}, "windows": windows,
            "metrics": {"url": "u", "scrapes": 25, "failures": 0,
                        "metrics": {"memory_bytes": "m", "device_memory_bytes": None, "kv_usage": "k"}}}
    return {"kind": "capacity", "target": {"url": "http://x", "model": "m"}, "slo": slo.as_dict(), "probes": probes,
            "result": {"verdict": "met", "max_concurrency": 3, "upper_bound": 4, "reason": "C=3 passed"},
            "soak": soak}


def test_capacity_files_and_consistency(tmp_path: Path) -> None:
    report = _capacity_report()
    files = rep.write_capacity_report(tmp_path, report, [{"probe": 0, "index": 1}])
    assert set(files) == {"requests", "markdown", "json", "plot", "soak_plot"}
    for name in ("capacity.png", "soak.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    data = json.loads((tmp_path / "capacity.json").read_text())
    md = (tmp_path / "capacity.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \| .* \| (\w+) \| (reason \d+) \|$", md, flags=re.M)
    assert [(int(i), int(c), stage, verdict) for i, c, stage, verdict, _ in rows] == [
        (p["id"], p["concurrency"], p["stage"], p["verdict"]) for p in data["probes"]]
    assert f"max concurrency: **{data['result']['max_concurrency']}**" in md
    for name, d in data["soak"]["drift"].items():
        assert f"| {name} | {d['verdict']} |" in md
    assert "Soak verdict: **drift**" in md
    assert data["soak"]["drift"]["memory_bytes"]["verdict"] == "drift"


def test_reports_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    report, results = _bench()
    files = rep.write_bench_report(tmp_path, report, results)
    assert "plot" not in files and "matplotlib" in files["plots_skipped"]
    assert json.loads((tmp_path / "bench.json").read_text())["files"]["plots_skipped"]
