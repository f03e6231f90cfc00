"""The tenants' priority inside the engine: a victim tenant's TTFT while another tenant floods, with the engine
scheduling first come first served (vLLM's default) and by the priority the gateway writes (``engine.scheduling_
policy: priority``; the victim's tenant has a higher ``priority``, and the flood goes over its fair share).

One real vLLM replica (the CPU build, the demo model), run twice, once per policy (a policy is an engine flag), the
same gateway settings both times. The gateway's admission limit is set above the engine's ``max_num_seqs`` so that
requests wait in the engine's own queue, which is where the policy acts (with the limit at ``max_num_seqs`` the
gateway's fair share holds the flood back itself: bench/tenant_fairness.py). Per policy, one phase at a time:

1. ``alone``: the victim (``--victim-concurrency`` clients of ``--victim-tokens``-token streams) with nobody else.
2. ``flood``: the aggressor floods (``--aggressor-concurrency`` clients of ``--aggressor-tokens``-token streams);
   once its flood is running, the victim runs again.

It prints the victim's TTFT p50/p90 per phase and policy, side by side, with ratios to the same policy's
``alone``, and the aggressor's tokens/s during each flood. Numbers, never assertions.

    .venv/bin/python bench/tenant_priority.py [--phase-seconds 30] [--max-num-seqs 4] [--limit 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_overhead import start, stop, wait_ok  # noqa: E402
from bench.tenant_fairness import KEYS, demo_model, engine_idle, phase  # noqa: E402


def run_policy(policy: str, model: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One appliance whose engine runs ``policy``: the victim alone, then under the flood."""
    state = Path(tempfile.mkdtemp(prefix=f"bench-priority-{policy}-"))
    tenants = [{"name": "victim", "api_keys": [KEYS["victim"]], "priority": 5},
               {"name": "aggressor", "api_keys": [KEYS["aggressor"]]}]
    limit = str(args.limit)
    port, engine_port = args.base_port + 10, args.base_port
    env = {"APPLIANCE_STATE_DIR": str(state), "APPLIANCE_TENANTS": json.dumps(tenants),
           "APPLIANCE_MODEL": str(model), "APPLIANCE_SERVED_MODEL_NAME": "demo", "APPLIANCE_PORT": str(port),
           "APPLIANCE_ENGINE_BASE_PORT": str(engine_port), "APPLIANCE_ENGINE__MAX_MODEL_LEN": "512",
           "APPLIANCE_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs),
           "APPLIANCE_ENGINE__SCHEDULING_POLICY": policy,
           "APPLIANCE_ADMISSION__INITIAL_LIMIT": limit, "APPLIANCE_ADMISSION__MIN_LIMIT": limit,
           "APPLIANCE_ADMISSION__MAX_LIMIT": limit, "APPLIANCE_ADMISSION__QUEUE_TIMEOUT_SECONDS": "300",
           "APPLIANCE_REQUEST_TIMEOUT_SECONDS": "900"}
    started = time.monotonic()
    proc = start([sys.executable, "-m", "appliance.cli", "serve"], env, state / "appliance.log")
    try:
        url, engine_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
        wait_ok(url + "/health/ready", proc)
        print(f"{policy}: ready in {time.monotonic() - started:.0f}s (logs {state})", flush=True)
        asyncio.run(phase(url, argparse.Namespace(**{**vars(args), "phase_seconds": 5}), flood=None))  # warm-up
        results = {}
        for name, flood in (("alone", None), ("flood", "read")):
            asyncio.run(engine_idle(engine_url))
            results[name] = asyncio.run(phase(url, args, flood=flood))
            print(f"{policy} {name}: done ({results[name]['n']} victim requests)", flush=True)
        return results
    finally:
        stop(proc)


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(f"\nvictim (priority 5): {args.victim_concurrency} clients x {args.victim_tokens}-token streams; aggressor "
          f"(priority 0): {args.aggressor_concurrency} clients x {args.aggressor_tokens}-token streams; one replica, "
          f"max_num_seqs {args.max_num_seqs}, gateway limit {args.limit}")
    print(f"{'policy':<9} {'phase':<6} {'n':>4} {'err':>4} {'TTFT p50 ms':>11} {'p90 ms':>8} {'p50 x alone':>11} "
          f"{'p90 x alone':>11} {'aggressor tok/s':>15}")
    for policy, phases in results.items():
        alone = phases["alone"]
        for name, r in phases.items():
            ratios = [f"{r[k] / alone[k]:.2f}" if r[k] is not None and alone[k] else "-" for k in ("p50", "p90")]
            p50, p90 = (f"{1000 * r[k]:.0f}" if r[k] is not None else "-" for k in ("p50", "p90"))
            tok = f"{r['aggressor']:.1f}" if r["aggressor"] is not None else "-"
            print(f"{policy:<9} {name:<6} {r['n']:>4} {r['errors']:>4} {p50:>11} {p90:>8} {ratios[0]:>11} "
                  f"{ratios[1]:>11} {tok:>15}")
    fcfs, prio = results.get("fcfs", {}).get("flood"), results.get("priority", {}).get("flood")
    if fcfs and prio and fcfs["p90"] and prio["p90"]:
        print(f"victim TTFT p90 under the flood, priority / fcfs: {prio['p90'] / fcfs['p90']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-seconds", type=float, default=30, help="victim run per phase (default 30)")
    parser.add_argument("--ramp-seconds", type=float, default=8, help="flood before the victim starts (default 8)")
    parser.add_argument("--victim-concurrency", type=int, default=2)
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--aggressor-concurrency", type=int, default=16)
    parser.add_argument("--aggressor-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="the engine's batch (default 4)")
    parser.add_argument("--limit", type=int, default=16, help="the gateway's admission limit (default 16)")
    parser.add_argument("--policies", default="fcfs,priority")
    parser.add_argument("--base-port", type=int, default=18800)
    parser.add_argument("--model", default=None, help="model directory (default: the tests' demo model)")
    args = parser.parse_args()
    model = demo_model(args.model)
    started = time.monotonic()
    results = {policy: run_policy(policy, model, args) for policy in args.policies.split(",")}
    report(results, args)
    print(f"total {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
