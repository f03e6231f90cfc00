"""The hook chain: the request's side in list order (an awaitable ``arrived`` awaited before the next hook), the
response's side in reverse, relay methods only on the hooks that override them, and a break's bytes through the
hooks after the one that resolved it."""

from __future__ import annotations

import asyncio
import time

from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.hook import Block, Break, End, HookChain, RequestHook, Resolution
from tests.gateway.upstream.support import begin, chain, exchange


class Tracer(RequestHook):
    def __init__(self, name: str, log: list[str], resolve: bool = False) -> None:
        self.name, self.log, self.resolve = name, log, resolve

    def admitted(self, attempt) -> None:
        self.log.append(f"admitted:{self.name}")

    def finished(self, end: End) -> None:
        self.log.append(f"finished:{self.name}")

    def relayed(self, block: Block) -> None:
        self.log.append(f"relayed:{self.name}")
        block.out += self.name.encode()

    async def broke(self, brk: Break) -> Resolution | None:
        self.log.append(f"broke:{self.name}")
        return Resolution(b"<" + self.name.encode() + b">", Outcome.FAILURE, 502) if self.resolve else None


class Silent(RequestHook):
    """Overrides nothing: the relay must never call it."""

    def __getattribute__(self, name: str):
        if name in ("relayed", "leg_closed", "held", "broke"):
            raise AssertionError(f"{name} called on a hook that does not override it")
        return super().__getattribute__(name)


def test_the_request_side_runs_in_order_and_the_response_side_in_reverse() -> None:
    log: list[str] = []
    ex = exchange({"prompt": "x", "stream": True})
    hooks = chain(ex, Tracer("a", log), Silent(), Tracer("b", log))
    begin(ex)
    block = Block(b"data: x\n\n", b"data: x\n\n", time.monotonic(), 1)
    hooks.relayed(block)
    hooks.finished(End(200, Outcome.SUCCESS, True, time.monotonic()))
    assert log == ["admitted:a", "admitted:b", "relayed:b", "relayed:a", "finished:b", "finished:a"]
    assert block.out == b"data: x\n\nba"  # the first hook sees what the client gets


def test_a_breaks_bytes_pass_the_hooks_after_the_one_that_resolved_it() -> None:
    log: list[str] = []
    ex = exchange({"prompt": "x", "stream": True})
    hooks = chain(ex, Tracer("client-side", log), Tracer("resolver", log, resolve=True), Tracer("engine-side", log))
    resolution = asyncio.run(hooks.broke(Break(ConnectionError(), "replica-0", "connection", time.monotonic())))
    assert resolution is not None and resolution.out == b"<resolver>client-side"
    assert log == ["broke:engine-side", "broke:resolver", "relayed:client-side"]


def test_no_hook_frames_unless_one_asks() -> None:
    class Framing(RequestHook):
        frames = True

    assert not HookChain([RequestHook(), Silent()]).frames
    assert HookChain([RequestHook(), Framing()]).frames


class Checker(RequestHook):
    """``arrived`` at once, or (``round_trip``) as an awaitable, as a shared quota store's check is."""

    def __init__(self, name: str, log: list[str], round_trip: bool = False, refuse: bool = False) -> None:
        self.name, self.log, self.round_trip, self.refuse = name, log, round_trip, refuse

    def arrived(self):
        if not self.round_trip:
            self.log.append(f"arrived:{self.name}")
            return None
        return self._check()

    async def _check(self) -> None:
        await asyncio.sleep(0)
        self.log.append(f"arrived:{self.name}")
        if self.refuse:
            raise ValueError(self.name)


def test_arrived_needs_no_coroutine_unless_a_hook_returns_one() -> None:
    log: list[str] = []
    assert HookChain([Checker("a", log), RequestHook(), Checker("b", log)]).arrived() is None
    assert log == ["arrived:a", "arrived:b"]


def test_an_awaitable_arrived_is_awaited_before_the_hooks_after_it() -> None:
    log: list[str] = []
    pending = HookChain([Checker("a", log), Checker("store", log, round_trip=True), Checker("b", log),
                         Checker("store2", log, round_trip=True), Checker("c", log)]).arrived()
    assert pending is not None and log == ["arrived:a"]  # the rest waits for the round trip
    asyncio.run(pending)
    assert log == ["arrived:a", "arrived:store", "arrived:b", "arrived:store2", "arrived:c"]


def test_a_refusal_after_a_round_trip_stops_the_hooks_after_it() -> None:
    log: list[str] = []
    pending = HookChain([Checker("store", log, round_trip=True, refuse=True), Checker("b", log)]).arrived()
    try:
        asyncio.run(pending)
    except ValueError:
        pass
    else:
        raise AssertionError("the refusal was lost")
    assert log == ["arrived:store"]
