"""Soak: steady load on the appliance for a long time (20+ minutes; run by hand, not in CI), watching for leaks
and drift in the three places they show:

- the gateway's resident memory (RSS), sampled every ``--sample-seconds``; growth is measured from the end of
  the warm-up (the first ``--warmup-minutes``) to the end: beyond what the prefix index grew by, it should stay
  under 5%. The index is a cache that fills by design up to ``routing.scorers.prefix.index_bytes`` (64 MiB):
  every new prompt adds its blocks, so under unique prompts it grows for hours (measured: 13 MB after 34,640
  64-token prompts), and its own gauge (``appliance_routing_prefix_index_bytes``) says by how much. The raw RSS
  growth is reported too;
- the series on the gateway's /metrics: flat over the second half of the soak (a label that grows with traffic
  keeps growing; a bounded one adds each value once, early); the series added after warm-up are listed by name;
- the TTFT/E2E P95 and throughput drift, judged by the project's own soak (``appliance capacity``'s windows and
  drift verdicts, appliance/loadtest/capacity.py) at a fixed concurrency: ttft_p95_s must not drift (< 10%).

Without ``--url`` it starts `appliance serve` on the demo model (``--replicas``) and stops it after; with
``--url`` it soaks a running appliance and reads the RSS of ``--gateway-pid`` when given.

    .venv/bin/python bench/soak.py --minutes 20 [--concurrency 4] [--replicas 2] [--out var/soak]

Prints one JSON summary (also written to OUT/soak.json). Numbers, never assertions; exit 1 when a verdict fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.cli.serve import ensure_demo_model  # noqa: E402
from appliance.loadtest.bench import SLO, Target  # noqa: E402
from appliance.loadtest.capacity import CapacityConfig, CapacitySearch  # noqa: E402
from appliance.loadtest.prompts import SyntheticPrompts, choose_counter  # noqa: E402

RSS_LIMIT = 0.05
TTFT_DRIFT_LIMIT = 0.10


def start_appliance(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen, str]:
    port = 18700
    model = ensure_demo_model(args.models_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")} | {
        "APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo",
        "APPLIANCE_REPLICAS": str(args.replicas), "APPLIANCE_PORT": str(port),
        "APPLIANCE_ENGINE_BASE_PORT": str(port + 1), "APPLIANCE_STATE_DIR": str(out / "state"),
        "APPLIANCE_ENGINE__MAX_NUM_SEQS": "32", "APPLIANCE_ADMISSION__QUEUE_TIMEOUT_SECONDS": "60"}
    log = (out / "appliance.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"appliance exited with {proc.returncode}; see {out / 'appliance.log'}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).json().get("ready_replicas", 0) >= args.replicas:
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    raise SystemExit("appliance not ready within 600 s")


PREFIX_INDEX_BYTES = "appliance_routing_prefix_index_bytes"


def scrape(url: str) -> tuple[frozenset[str], float | None]:
    """Every series on /metrics, as ``name{label="value",...}`` (a count says that the set grew, the keys say
    which), and the prefix index's accounted bytes."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    index = next((sample.value for sample in samples if sample.name == PREFIX_INDEX_BYTES), None)
    return frozenset(f"{sample.name}{dict(sorted(sample.labels.items()))}" for sample in samples), index


async def sample(url: str, pid: int | None, every: float, stop: asyncio.Event, rows: list[dict[str, Any]]) -> None:
    process = psutil.Process(pid) if pid else None
    start = time.monotonic()
    while not stop.is_set():
        row: dict[str, Any] = {"t_s": round(time.monotonic() - start, 1)}
        if process is not None:
            row["rss_bytes"] = process.memory_info().rss
        try:
            keys, row["prefix_index_bytes"] = await asyncio.to_thread(scrape, url)
            row["series"] = len(keys)
            row["_keys"] = keys
        except httpx.HTTPError:
            row["series"] = None
        rows.append(row)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


def summarize(rows: list[dict[str, Any]], warmup_s: float, soak: dict[str, Any]) -> dict[str, Any]:
    after = [r for r in rows if r["t_s"] >= warmup_s] or rows
    rss = [r["rss_bytes"] for r in after if r.get("rss_bytes")]
    # The index's gauge from the same sample as each RSS reading (absent where the scrape failed: counted as 0 growth).
    index = [r.get("prefix_index_bytes") or 0 for r in after if r.get("rss_bytes")]
    beyond_index = (rss[-1] - rss[0] - (index[-1] - index[0])) / rss[0] if rss else None
    series = [r["series"] for r in after if r.get("series") is not None]
    keyed = [r for r in after if r.get("_keys") is not None]
    added = sorted(keyed[-1]["_keys"] - keyed[0]["_keys"]) if keyed else []
    # A label that grows with traffic keeps adding series to the end; one bounded by a known set adds its values the
    # first time each occurs (a status code, a finish reason) and then stops. Judge the second half of the soak.
    second_half = [r["series"] for r in keyed[len(keyed) // 2:]]
    ttft = soak["drift"]["ttft_p95_s"]
    summary = {
        "samples": len(rows),
        "rss_after_warmup_bytes": rss[0] if rss else None, "rss_end_bytes": rss[-1] if rss else None,
        "rss_growth": (rss[-1] - rss[0]) / rss[0] if rss else None,
        "prefix_index_after_warmup_bytes": index[0] if index else None,
        "prefix_index_end_bytes": index[-1] if index else None,
        "rss_growth_beyond_prefix_index": beyond_index,
        "series_after_warmup": series[0] if series else None, "series_end": series[-1] if series else None,
        "series_max": max(series) if series else None,
        "series_added_after_warmup": added[:30],
        "series_second_half_first": second_half[0] if second_half else None,
        "series_second_half_end": second_half[-1] if second_half else None,
        "soak_verdict": soak["verdict"], "invalid_reason": soak.get("invalid_reason"),
        # Which series made the soak's verdict (engine memory, throughput, ...), not only the overall word.
        "drift_verdicts": {name: drift["verdict"] for name, drift in soak["drift"].items()},
        "ttft_p95_verdict": ttft["verdict"],
        "ttft_p95_first_s": ttft["first"], "ttft_p95_last_s": ttft["last"],
        "ttft_p95_change": ttft["first_last_change"], "ttft_p95_trend_change": ttft["trend_change"],
        "requests": soak["summary"].get("requests"), "succeeded": soak["summary"].get("succeeded"),
        "errors": soak["summary"].get("errors"),
    }
    summary["pass"] = {
        # The designed fill of a bounded cache is not a leak; what grows beyond it is.
        "rss_growth_beyond_prefix_index_below_5pct": beyond_index is None or beyond_index < RSS_LIMIT,
        "series_flat_in_second_half": bool(second_half) and max(second_half) == second_half[0],
        "ttft_p95_stable": ttft["verdict"] == "stable",  # "suspect" (a trend, not yet significant) is not a pass
        "soak_valid": soak["verdict"] != "invalid",  # the load generator kept up (else the numbers mean little)
    }
    return summary


async def soak(args: argparse.Namespace, url: str, pid: int | None, out: Path) -> dict[str, Any]:
    target = Target(url, args.model)
    counter = choose_counter(url, args.model, None, None)
    prompts = SyntheticPrompts(counter, args.prompt_tokens, 0, args.max_tokens)
    config = CapacityConfig(target=target, slo=SLO(ttft_s=args.slo_ttft_ms / 1000), soak_s=args.minutes * 60,
                            soak_window_s=args.window_seconds, metrics_url=f"{url}/metrics", progress=False)
    rows: list[dict[str, Any]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(url, pid, args.sample_seconds, stop, rows))
    try:
        result = await CapacitySearch(config, prompts, log=print).soak(args.concurrency)
    finally:
        stop.set()
        await sampler
    (out / "samples.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "_keys"} for r in rows],
                                                 indent=1))
    (out / "soak-windows.json").write_text(json.dumps(result["windows"], indent=1, default=str))
    return summarize(rows, args.warmup_minutes * 60, result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--url", help="soak a running appliance instead of starting one")
    parser.add_argument("--gateway-pid", type=int, help="with --url: the gateway's pid, for its RSS")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--window-seconds", type=float, help="soak window (default: 1/30 of the soak, >= 10 s)")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--models-dir", type=Path, default=Path("var/models"), help="where the demo model is "
                        "built once and reused")
    parser.add_argument("--out", type=Path, default=Path("var/soak"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc = None
    url, pid = args.url, args.gateway_pid
    if url is None:
        proc, url = start_appliance(args, args.out)
        pid = proc.pid
    try:
        summary = asyncio.run(soak(args, url, pid, args.out))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    summary["minutes"] = args.minutes
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if all(summary["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
