"""The relay's own cost of hiding a usage event the client did not ask for (issue 23's tenant accounting asks every
stream's engine for usage): the per-chunk work of the plain relay against the hidden-usage relay, in one run, on
the same vLLM-shaped chunks. In-process, no network: what the gateway's CPU pays per 1,000 streamed events.

Prints milliseconds per 1,000 events for each path (best of the rounds) and their ratio. Numbers, never assertions.

    .venv/bin/python bench/usage_relay.py [--tokens 256] [--streams 200] [--rounds 5] [--events-per-chunk 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.gateway import migration  # noqa: E402
from appliance.gateway.tenants.accounting import HiddenUsage  # noqa: E402


def vllm_stream(tokens: int) -> list[bytes]:
    """The events of one chat stream as vLLM writes them with include_usage: content chunks, the finishing chunk,
    the usage event, [DONE]."""
    head = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1764800000,
            "model": "demo"}

    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps({**head, **obj}, separators=(",", ":")).encode() + b"\n\n"

    out = [event({"choices": [{"index": 0, "delta": {"content": f" word{i}"}, "logprobs": None,
                               "finish_reason": None}]}) for i in range(tokens - 1)]
    out.append(event({"choices": [{"index": 0, "delta": {"content": " end"}, "logprobs": None,
                                   "finish_reason": "length", "stop_reason": None}]}))
    out.append(event({"choices": [], "usage": {"prompt_tokens": 12, "total_tokens": 12 + tokens,
                                                "completion_tokens": tokens}, "system_fingerprint": "fp"}))
    out.append(migration.DONE)
    return out


def chunks_of(events: list[bytes], per_chunk: int) -> list[bytes]:
    """The events as the engine's socket delivers them: ``per_chunk`` events a read, every other read split in
    two mid-event (a partial event is the case the framing exists for)."""
    out = []
    for i in range(0, len(events), per_chunk):
        block = b"".join(events[i:i + per_chunk])
        if (i // per_chunk) % 2:
            cut = len(block) // 2
            out += [block[:cut], block[cut:]]
        else:
            out.append(block)
    return out


def plain(chunks: list[bytes]) -> bytes:
    """The plain relay's per-chunk bookkeeping (proxy.Upstream._relay): count events, keep a tail."""
    sent, tail = [], b""
    for chunk in chunks:
        chunk.count(b"data: ")
        tail = (tail + chunk)[-2048:]
        sent.append(chunk)
    return b"".join(sent)


def hidden(chunks: list[bytes]) -> bytes:
    """The same plus whole-event framing and HiddenUsage, as the relay does when the client did not ask for usage."""
    sent, tail = [], b""
    events, hide = migration.SSEEvents(), HiddenUsage()
    for chunk in chunks:
        chunk.count(b"data: ")
        tail = (tail + chunk)[-2048:]
        out = hide.feed(events.feed_block(chunk))
        if out:
            sent.append(out)
    sent.append(hide.flush() + events.pending)
    return b"".join(sent)


def timed(relay, streams: list[list[bytes]]) -> float:
    started = time.perf_counter()
    for chunks in streams:
        relay(chunks)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--events-per-chunk", type=int, default=1)
    args = parser.parse_args()
    events = vllm_stream(args.tokens)
    chunks = chunks_of(events, args.events_per_chunk)
    expected = b"".join(e for e in events if b'"usage"' not in e).replace(
        b'"stop_reason":null}]}', b'"stop_reason":null}],"system_fingerprint":"fp"}')
    assert hidden(chunks) == expected, "the hidden-usage relay changed the client's bytes"
    streams = [chunks] * args.streams
    total = len(events) * args.streams
    best = {"plain": float("inf"), "hidden usage": float("inf")}
    for _ in range(args.rounds):  # alternating, so both see the same machine
        best["plain"] = min(best["plain"], timed(plain, streams))
        best["hidden usage"] = min(best["hidden usage"], timed(hidden, streams))
    per_k = {name: seconds / total * 1000 * 1000 for name, seconds in best.items()}  # ms per 1,000 events
    print(f"{args.streams} streams x {len(events)} events, {args.events_per_chunk} event(s) a read, every other read "
          f"split mid-event; best of {args.rounds}")
    for name, ms in per_k.items():
        print(f"  {name:13s} {ms:8.3f} ms per 1,000 events")
    print(f"  ratio hidden/plain: {per_k['hidden usage'] / per_k['plain']:.2f}x; "
          f"added: {per_k['hidden usage'] - per_k['plain']:.3f} ms per 1,000 events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
