"""Hiding the usage event the gateway asked for on streams of several choices (``n`` > 1, several prompts), and
each engine's fingerprint remembered (``usage.HiddenUsage``, ``fingerprint.Fingerprints``).

vLLM (0.32, ``completion_stream_generator`` / ``chat_completion_stream_generator``) writes one choice a chunk, a
choice's finishing chunk is its last, and its server's one ``system_fingerprint`` goes on every finishing chunk when
the client asked for no usage event, on the usage event (only) when it did. The client that did not ask must get
every other chunk as the engine sends it, whatever another choice's finish waits for, and the gateway holds at most
one finishing chunk per choice. Real engines: tests/integration/test_tenants.py."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from appliance.gateway.admission.limit import ConcurrencyLimits
from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome, Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.fingerprint import Fingerprint, Fingerprints
from appliance.gateway.tenants.metering import Metering
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.usage import HiddenUsage
from appliance.gateway.upstream.sse import DONE, SSEEvents
from tests.doubles import FakeClock, FakeReplica
from tests.gateway.upstream.support import begin, block, chain, exchange

FP = "vllm-0.32.0-5f0c9a1e"


def chunk(index: int, text: str, finish: str | None = None, *, chat: bool = False,
          fingerprint: str | None = None) -> bytes:
    """One choice's chunk as vLLM writes it (compact, its fields in its models' order; the fingerprint last)."""
    head: dict[str, Any] = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": 1, "model": "demo"}
    if chat:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                  "prompt_token_ids": None, "token_ids": None}
    event: dict[str, Any] = {**head, "choices": [choice]}
    if fingerprint is not None:
        event["system_fingerprint"] = fingerprint
    return _sse(event)


def usage_event(completion: int, fingerprint: str | None = FP, *, chat: bool = False) -> bytes:
    event: dict[str, Any] = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": 1, "model": "demo", "choices": [],
                             "usage": {"prompt_tokens": 3, "total_tokens": 3 + completion,
                                       "completion_tokens": completion}}
    if fingerprint is not None:
        event["system_fingerprint"] = fingerprint
    return _sse(event)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def test_a_choice_that_finished_early_holds_back_none_of_the_others_tokens() -> None:
    """n=2, the fingerprint not known yet: choice 0 finishes first; every token of choice 1 after it reaches the
    client the moment it is fed, and choice 0's finish comes with the fingerprint when the usage event does."""
    hidden = HiddenUsage()
    assert hidden.feed(chunk(0, "a")) == chunk(0, "a")
    assert hidden.feed(chunk(1, "b")) == chunk(1, "b")
    assert hidden.feed(chunk(0, "c", "stop")) == b""  # waits for the fingerprint
    for i in range(5):
        assert hidden.feed(chunk(1, f"d{i}")) == chunk(1, f"d{i}")
    assert hidden.feed(chunk(1, "e", "length")) == b""
    assert hidden.feed(usage_event(9)) == chunk(0, "c", "stop", fingerprint=FP) + chunk(1, "e", "length",
                                                                                          fingerprint=FP)
    assert hidden.feed(DONE) == DONE
    assert hidden.usage == {"prompt_tokens": 3, "total_tokens": 12, "completion_tokens": 9}


def test_a_known_fingerprint_holds_nothing_and_keeps_the_engines_order() -> None:
    hidden = HiddenUsage(Fingerprint(FP))
    assert hidden.feed(chunk(0, "c", "stop")) == chunk(0, "c", "stop", fingerprint=FP)
    assert hidden.feed(chunk(1, "d")) == chunk(1, "d")
    assert hidden.feed(chunk(1, "e", "length") + usage_event(3) + DONE) == chunk(1, "e", "length",
                                                                                fingerprint=FP) + DONE
    assert hidden.reported == Fingerprint(FP)
    none = HiddenUsage(Fingerprint(None))  # --fingerprint-mode none: the finishing chunks carry none
    assert none.feed(chunk(0, "c", "stop")) == chunk(0, "c", "stop")
    assert none.feed(usage_event(1, None) + DONE) == DONE and none.reported == Fingerprint(None)


def test_what_is_held_is_one_finish_per_choice_whatever_the_streams_length() -> None:
    """10,000 events of choice 1 after choice 0's finish: all of them out as they come, only the finish held."""
    hidden = HiddenUsage()
    finish = chunk(0, "x", "stop")
    assert hidden.feed(finish) == b""
    sent = streamed = 0
    for i in range(10_000):
        event = chunk(1, f"t{i}")
        streamed += len(event)
        sent += len(hidden.feed(event))
        assert sent == streamed
    assert hidden.held_bytes == len(finish)
    assert hidden.feed(usage_event(10_001)) == chunk(0, "x", "stop", fingerprint=FP)
    assert hidden.held_bytes == 0


def test_a_stream_that_ends_without_usage_gives_back_its_finishes_before_the_end() -> None:
    """An engine's error event or [DONE] without a usage event: the held finishes go first, as they came."""
    hidden = HiddenUsage()
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}\n\n'
    assert hidden.feed(chunk(0, "c", "stop")) == b""
    assert hidden.feed(chunk(1, "d") + error + DONE) == chunk(1, "d") + chunk(0, "c", "stop") + error + DONE


# -- property: any interleaving of the choices, any framing -----------------------------------------------------


Stream = tuple[list[list[bytes]], list[int], bool, str | None, list[int]]


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    """Each choice's chunks (tokens, then its finish), the order the engine interleaves them in, chat or
    completions, the engine's fingerprint (None: it writes none), and where the reads cut the stream."""
    chat = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    # Generated text that spells the relay's markers (escaped in the JSON, so never one)
    noise = draw(st.sampled_from(["", "data: ", '"choices":[{"index":0', '"finish_reason":"stop"', "\n\ndata: "]))
    choices = [[chunk(index, f"t{index}.{i}{noise}", chat=chat) for i in range(length)]
               + [chunk(index, f"end{index}", draw(st.sampled_from(["stop", "length"])), chat=chat)]
               for index, length in enumerate(lengths)]
    order = draw(st.permutations([index for index, events in enumerate(choices) for _ in events]))
    fingerprint = draw(st.sampled_from([FP, "custom \"fp\" é", None]))  # --fingerprint-value: any text
    cuts = draw(st.lists(st.integers(1, 5_000), max_size=12))
    return choices, order, chat, fingerprint, cuts


@settings(max_examples=300, deadline=None)
@given(streams(), st.booleans())
def test_the_client_gets_the_engines_stream_without_usage_with_each_event_as_soon_as_it_can(stream: Stream,
                                                                                           known: bool) -> None:
    """Property: whatever the interleaving of choices and finishes and wherever the reads cut the events, the
    client gets what vLLM writes a client that asked for no usage: with the fingerprint known beforehand, those
    very bytes, each event as soon as its read is whole; not known, the same except that each finishing chunk
    comes when the usage event does (each choice's own events in order: a client reassembles by ``index``), every
    other event as soon as its read is whole, and never more held than one finish per choice."""
    choices, order, chat, fingerprint, cuts = stream
    position = [0] * len(choices)
    interleaved = []
    for index in order:
        interleaved.append(choices[index][position[index]])
        position[index] += 1
    engine = b"".join(interleaved) + usage_event(len(order), fingerprint, chat=chat) + DONE
    finishes = [event for event in interleaved if b'"finish_reason":"' in event]
    stamped = {event: _stamp(event, fingerprint) for event in finishes}
    without_usage = b"".join(stamped.get(event, event) for event in interleaved) + DONE  # what vLLM writes

    hidden = HiddenUsage(Fingerprint(fingerprint) if known else None)
    bounds = [0, *sorted({cut % len(engine) for cut in cuts} - {0}), len(engine)]
    framing, fed, out = SSEEvents(), b"", b""
    for a, b in zip(bounds, bounds[1:], strict=False):
        whole = framing.feed_block(engine[a:b])
        fed += whole
        out += hidden.feed(whole)
        assert out == _due(_events(fed), stamped, known)  # everything that may go out has, at once
        assert hidden.held_bytes <= sum(len(finish) for finish in finishes)
    out += hidden.flush() + framing.pending
    if known:
        assert out == without_usage
    else:
        later = b"".join(stamped[event] for event in finishes)
        assert out == b"".join(e for e in interleaved if e not in stamped) + later + DONE
    assert hidden.usage is not None and hidden.reported == Fingerprint(fingerprint)


def _due(fed: list[bytes], stamped: dict[bytes, bytes], known: bool) -> bytes:
    """What the client must have been sent once ``fed`` (whole events) reached the gateway: every event but the
    usage event, finishes stamped; finishes whose fingerprint is not known yet only once the usage event came."""
    usage_at = next((i for i, e in enumerate(fed) if b'"choices":[],"usage"' in e), None)
    if known:
        return b"".join(stamped.get(e, e) for i, e in enumerate(fed) if i != usage_at)
    before = fed if usage_at is None else fed[:usage_at]
    out = b"".join(e for e in before if e not in stamped)
    if usage_at is not None:
        out += b"".join(stamped[e] for e in before if e in stamped) + b"".join(fed[usage_at + 1:])
    return out


def _stamp(event: bytes, fingerprint: str | None) -> bytes:
    if fingerprint is None:
        return event
    return event[:-3] + b',"system_fingerprint":' + json.dumps(fingerprint, ensure_ascii=False).encode() + b"}\n\n"


def _events(data: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in data.split(b"\n\n") if part]




# -- each engine's fingerprint, remembered ----------------------------------------------------------------------


def test_an_engines_fingerprint_is_known_from_its_report_until_it_restarts() -> None:
    replica = FakeReplica("replica-0")
    fleet = ["replica-0", "replica-1"]
    fingerprints = Fingerprints(lambda: fleet)
    key = ("replica-0", replica.url, 0)
    assert fingerprints.known(key) is None
    fingerprints.learn(key, Fingerprint(FP))
    assert fingerprints.known(key) == Fingerprint(FP)
    assert fingerprints.known(("replica-0", replica.url, 1)) is None  # restarted: unknown until it reports
    assert fingerprints.known(("replica-1", replica.url, 0)) is None
    fingerprints.learn(key, Fingerprint("changed"))  # reconfigured behind the gateway's back: followed, counted
    assert fingerprints.known(key) == Fingerprint("changed") and fingerprints.changed == 1
    fingerprints.learn(("replica-1", "http://b", 0), Fingerprint(None))
    assert fingerprints.known(("replica-1", "http://b", 0)) == Fingerprint(None)
    fleet[:] = ["replica-1", "replica-2"]  # replica-0 left the fleet: dropped when a new one reports
    fingerprints.learn(("replica-2", "http://c", 0), Fingerprint(FP))
    assert fingerprints.known(key) is None and fingerprints.known(("replica-2", "http://c", 0)) == Fingerprint(FP)


def _metering() -> Metering:
    quotas = Quotas([Tenant("team-a")], FakeClock())
    accounting = TenantAccounting(CollectorRegistry(), slo_ttft_seconds=1.0, ratios=quotas.ratios)
    accounting.configure(["team-a"])
    admission = Admission(Router(lambda: []), ConcurrencyLimits(None), max_queue=0, queue_timeout_seconds=1)
    return Metering(accounting, quotas, admission, max_model_len=1000)


def _relay(metering: Metering, kind: str = "first") -> list[bytes]:
    """One n=2 stream through the metering hook (its client asked for no usage): what the client got per event."""
    ex = exchange({"prompt": "hi", "n": 2, "max_tokens": 3, "stream": True})
    hooks = chain(ex, metering.start(ex))
    hooks.arrived()
    begin(ex, kind=kind)
    out = []
    for event in (chunk(0, "a", "stop"), chunk(1, "b"), chunk(1, "c", "length"), usage_event(3), DONE):
        b = block(event)
        hooks.relayed(b)
        out.append(b.out)
    ex.settle(Outcome.SUCCESS)
    return out


def test_the_second_stream_from_an_engine_holds_nothing() -> None:
    """The first n=2 stream from an engine waits for its usage event to stamp the finishes (choice 1's tokens do
    not); from then on the engine's finishes go out stamped as they come, in the engine's order; a continuation's
    (the gateway's rewrite, no fingerprint to add) waits as before."""
    metering = _metering()
    first = _relay(metering)
    assert first == [b"", chunk(1, "b"), b"", chunk(0, "a", "stop", fingerprint=FP)
                     + chunk(1, "c", "length", fingerprint=FP), DONE]
    second = _relay(metering)
    assert second == [chunk(0, "a", "stop", fingerprint=FP), chunk(1, "b"), chunk(1, "c", "length", fingerprint=FP),
                      b"", DONE]
    assert _relay(metering, kind="continuation") == first
