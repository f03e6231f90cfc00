"""The relay's own cost of hiding the usage the client did not ask for (tenant accounting asks every stream's
engine for its final usage and its running usage on every chunk): the per-chunk work of the plain relay, the
relay hiding the final usage event only (the engine's fingerprint not known yet, so the finishing chunk waits for
the usage event; and known, from the engine's earlier streams), and the relay that also reads the running usage of
every chunk and strips it (what the gateway does now), in one run, on vLLM-shaped chunks. In-process, no network:
what the gateway's CPU pays per 1,000 streamed events.

Prints milliseconds per 1,000 events for each path (best of the rounds) and their ratios, and the most bytes the
hidden-usage relay holds back on a stream of two choices whose first finishes early (the engine's fingerprint not
known yet). Numbers, never assertions.

    .venv/bin/python bench/usage_relay.py [--tokens 256] [--streams 200] [--rounds 5] [--events-per-chunk 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.gateway.tenants.fingerprint import Fingerprint  # noqa: E402
from appliance.gateway.tenants.usage import HiddenUsage, RunningUsage, strip_running_usage  # noqa: E402
from appliance.gateway.upstream.sse import SSEEvents  # noqa: E402
from tests.fake_engine import CountingModel, FakeEngine  # noqa: E402

# vLLM's bytes, from the tests' fake engine (tests/fake_engine.py): a fixed id and time, so every stream is the same.
ENGINE = FakeEngine(model=CountingModel(prefix=" word"), response_id="chatcmpl-0123456789abcdef", created=1764800000,
                    system_fingerprint="fp")


def vllm_stream(tokens: int, *, usage: bool = True, running: bool = False) -> list[bytes]:
    """The events of one chat stream as vLLM writes them: the role chunk, content chunks, the finishing chunk, then
    with include_usage the usage event (and the fingerprint there, not on the finishing chunk), [DONE]; with
    ``running``, the running usage on every chunk too (continuous_usage_stats)."""
    body: dict = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about the import system."}],
                  "max_tokens": tokens, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": running}
    return ENGINE.stream_events(body)


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


def hidden(chunks: list[bytes], fingerprint: Fingerprint | None = None) -> bytes:
    """The same plus whole-event framing and HiddenUsage, as the relay does when the client did not ask for usage
    (``fingerprint``: the engine's, known beforehand)."""
    sent, tail = [], b""
    events, hide = SSEEvents(), HiddenUsage(fingerprint)
    for chunk in chunks:
        chunk.count(b"data: ")
        tail = (tail + chunk)[-2048:]
        out = hide.feed(events.feed_block(chunk))
        if out:
            sent.append(out)
    sent.append(hide.flush() + events.pending)
    return b"".join(sent)


def known(chunks: list[bytes]) -> bytes:
    return hidden(chunks, Fingerprint(ENGINE.system_fingerprint))


def running(chunks: list[bytes]) -> bytes:
    """The same plus the running usage read (RunningUsage) and stripped from every chunk, as the relay does now."""
    sent, tail = [], b""
    events, hide, seen = SSEEvents(), HiddenUsage(), RunningUsage()
    for at, chunk in enumerate(chunks):
        chunk.count(b"data: ")
        tail = (tail + chunk)[-2048:]
        block = events.feed_block(chunk)
        seen.feed(block, float(at))
        out = hide.feed(strip_running_usage(block))
        if out:
            sent.append(out)
    sent.append(hide.flush() + events.pending)
    return b"".join(sent)


def held_two_choices(tokens: int) -> int:
    """The most bytes HiddenUsage holds back (fed, not yet sent) on an n=2 chat stream whose choice 0 finishes after
    10 tokens while choice 1 streams ``tokens`` more, the engine's fingerprint not known beforehand."""
    head = b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764800000,' \
           b'"model":"demo","choices":[{"index":'

    def chunk(index: int, text: str, finish: str | None = None) -> bytes:
        tail = f'"{finish}","stop_reason":null' if finish else "null"
        return head + f'{index},"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{tail},' \
                      f'"token_ids":null}}]}}\n\n'.encode()

    usage = (b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764800000,'
             b'"model":"demo","choices":[],"usage":{"prompt_tokens":3,"total_tokens":9,"completion_tokens":6},'
             b'"system_fingerprint":"fp"}\n\n')
    events = [chunk(i % 2, f" w{i}") for i in range(20)] + [chunk(0, " end", "length")]
    events += [chunk(1, f" v{i}") for i in range(tokens)] + [chunk(1, " end", "length")]
    hide, fed, sent, most = HiddenUsage(), 0, 0, 0
    for event in events:
        fed += len(event)
        sent += len(hide.feed(event))
        most = max(most, fed - sent)
    hide.feed(usage)
    return most


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
    with_running = chunks_of(vllm_stream(args.tokens, running=True), args.events_per_chunk)
    expected = b"".join(vllm_stream(args.tokens, usage=False))  # what vLLM sends a client that did not ask
    assert hidden(chunks) == expected, "the hidden-usage relay changed the client's bytes"
    assert known(chunks) == expected, "the hidden-usage relay (fingerprint known) changed the client's bytes"
    assert running(with_running) == expected, "the running-usage relay changed the client's bytes"
    paths = {"plain": (plain, chunks), "hidden usage": (hidden, chunks), "hidden, fp known": (known, chunks),
             "+ running": (running, with_running)}
    total = len(events) * args.streams
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(args.rounds):  # alternating, so all see the same machine
        for name, (relay, stream) in paths.items():
            best[name] = min(best[name], timed(relay, [stream] * args.streams))
    per_k = {name: seconds / total * 1000 * 1000 for name, seconds in best.items()}  # ms per 1,000 events
    print(f"{args.streams} streams x {len(events)} events, {args.events_per_chunk} event(s) a read, every other read "
          f"split mid-event; best of {args.rounds}")
    for name, ms in per_k.items():
        print(f"  {name:16s} {ms:8.3f} ms per 1,000 events  ({ms / per_k['plain']:.2f}x plain)")
    print(f"  added by the running usage: {per_k['+ running'] - per_k['hidden usage']:.3f} ms per 1,000 events")
    print(f"  held back, n=2 stream with 10,000 tokens after choice 0 ends: at most {held_two_choices(10_000):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
