"""Hostile intake: the gateway's resident memory (RSS) under N connections without an API key, each declaring a
~1 MB body, sending most of it, then stalling (150 such connections grew the gateway from 75 to 224 MiB
and stayed open). Target: growth under 50 MB, every connection answered 401 or closed, the gateway still serving.

Starts `appliance serve` with API keys set and an engine URL nobody listens on (no engine is needed: nothing
gets past the key check), measures RSS before the flood, its peak while the connections stall, and after; counts
how each connection ended. Numbers, never assertions.

    .venv/bin/python bench/intake_flood.py [--connections 150] [--declared 1000000] [--sent 990000]
        [--hold-seconds 5] [--port 18790]

Prints one JSON object.
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
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_overhead import wait_ok  # noqa: E402

KEY = "bench-key"
MIB = 1024 * 1024


def start_gateway(port: int, state: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")} | {
        "APPLIANCE_PORT": str(port), "APPLIANCE_ENGINE_URLS": f"http://127.0.0.1:{port + 1}",
        "APPLIANCE_API_KEYS": KEY, "APPLIANCE_STATE_DIR": str(state), "APPLIANCE_LOG_LEVEL": "warning",
        "APPLIANCE_COLLECTORS__PROBE_BANDWIDTH": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve"], env=env,
                            stdout=(state / "gateway.log").open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    try:
        wait_ok(f"http://127.0.0.1:{port}/health/live", proc, timeout=120, interval=0.5)
    except RuntimeError:
        raise SystemExit(f"gateway exited with {proc.returncode}; see {state / 'gateway.log'}") from None
    except TimeoutError:
        proc.send_signal(signal.SIGTERM)
        raise SystemExit("gateway did not answer /health/live within 120 s") from None
    return proc


async def stalled_client(port: int, declared: int, sent: int, opened: asyncio.Event, hold: asyncio.Event) -> str:
    """One connection: headers without Authorization, ``sent`` bytes of a ``declared``-byte body, then silence.
    Returns how it ended by the end of the hold: the status it got, "closed", or "open"."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "refused"
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                     f"content-length: {declared}\r\n\r\n".encode() + b"x" * sent)
        with contextlib.suppress(TimeoutError, OSError):  # the server stopped reading: its answer says the rest
            await asyncio.wait_for(writer.drain(), timeout=10)
        opened.set()
        await hold.wait()
        try:
            head = await asyncio.wait_for(reader.read(64), timeout=0.05)
        except TimeoutError:
            return "open"
        except OSError:
            return "closed"
        if head.startswith(b"HTTP/1.1 "):
            return head[9:12].decode()
        return "closed" if not head else "other"
    finally:
        writer.close()


def rss(proc: psutil.Process) -> int:
    return proc.memory_info().rss


async def flood(args: argparse.Namespace, gateway: psutil.Process) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=10) as client:
        for _ in range(20):  # warm the paths the flood takes (and a served one) before the baseline
            await client.post("/v1/chat/completions", content=b"{}")
            await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        await asyncio.sleep(1)
        before = rss(gateway)
        hold = asyncio.Event()
        opened = [asyncio.Event() for _ in range(args.connections)]
        tasks = [asyncio.create_task(stalled_client(args.port, args.declared, args.sent, opened[i], hold))
                 for i in range(args.connections)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)), timeout=120)
        peak = rss(gateway)
        deadline = time.monotonic() + args.hold_seconds
        while time.monotonic() < deadline:
            peak = max(peak, rss(gateway))
            await asyncio.sleep(0.1)
        during = rss(gateway)
        hold.set()
        ends = await asyncio.gather(*tasks)
        await asyncio.sleep(1)
        after = rss(gateway)
        served = (await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code
    counts: dict[str, int] = {}
    for end in ends:
        counts[end] = counts.get(end, 0) + 1
    return {"connections": args.connections, "declared_bytes": args.declared, "sent_bytes": args.sent,
            "rss_before_mib": round(before / MIB, 1), "rss_peak_mib": round(peak / MIB, 1),
            "rss_during_stall_mib": round(during / MIB, 1), "rss_after_mib": round(after / MIB, 1),
            "growth_mb": round((peak - before) / 1e6, 1), "target_growth_mb": 50,
            "ended": counts, "served_after": served}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=150)
    parser.add_argument("--declared", type=int, default=1_000_000, help="Content-Length each one declares")
    parser.add_argument("--sent", type=int, default=990_000, help="body bytes each one sends before stalling")
    parser.add_argument("--hold-seconds", type=float, default=5.0, help="how long the connections stall")
    parser.add_argument("--port", type=int, default=18790)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="intake-flood-") as state:
        proc = start_gateway(args.port, Path(state))
        try:
            result = asyncio.run(flood(args, psutil.Process(proc.pid)))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
