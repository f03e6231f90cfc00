"""An engine's KV-cache events as vLLM publishes them: vLLM's own publisher (ZmqEventPublisher: its PUB socket, its
numbering, its replay buffer and ROUTER socket) sending batches of vLLM's own event classes, on loopback, over a
modelled prefix cache that the tests compare the gateway's index against.

The model is the engine's block map as the events describe it: block key -> copies. ``drop`` makes the PUB socket
lose the next batches on the way out (as a network would); the replay buffer still holds them.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from appliance.gateway.routing.kv_events.wire import block_key


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def digest(n: int) -> bytes:
    """A 32-byte block hash (as vLLM's sha256 ones) whose index key is a 64-bit spread of ``n``."""
    return bytes(24) + (n * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "big")


class _LossyPub:
    """Wraps the publisher's PUB socket: the next ``drop`` sends go nowhere."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.drop = 0

    def send_multipart(self, frames: Any) -> None:
        if self.drop > 0:
            self.drop -= 1
            return
        self.sock.send_multipart(frames)

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger=linger)


class Engine:
    """One engine's event side. ``events``/``replay``: the ports (the gateway connects on 127.0.0.1)."""

    def __init__(self, *, replay: bool = True, buffer_steps: int = 10_000, events_port: int | None = None,
                 replay_port: int | None = None) -> None:
        self.events_port = events_port or free_port()
        self.replay_port = (replay_port or free_port()) if replay else None
        self.buffer_steps = buffer_steps
        self.cache: Counter[int] = Counter()
        self.published = 0  # batches published by the current publisher (its next number)
        self._start()

    def _start(self) -> None:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
        deadline = time.monotonic() + 5
        while True:  # the last publisher's sockets close in ZeroMQ's own thread, a moment after shutdown()
            try:
                # The endpoint the appliance gives its engines (appliance/engine/kv_events.py): vLLM binds it, on
                # loopback only.
                self.publisher = ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{self.events_port}",
                                                   replay_endpoint=replay, buffer_steps=self.buffer_steps)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._lossy = _LossyPub(self.publisher._pub)
        self.publisher._pub = self._lossy  # type: ignore[assignment]
        self.published = 0

    @property
    def endpoints(self) -> tuple[str, str | None]:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
        return f"tcp://127.0.0.1:{self.events_port}", replay

    def drop(self, batches: int) -> None:
        self._lossy.drop += batches

    def restart(self) -> None:
        """A new engine process on the same ports: an empty cache, batches numbered from 0 again."""
        self.publisher.shutdown()
        self.cache.clear()
        self._start()

    def close(self) -> None:
        self.publisher.shutdown()

    def publish(self, *events: Any) -> None:
        """One batch (one scheduler step), applied to the model as the engine's cache changed."""
        for event in events:
            self._model(event)
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
        self.published += 1

    def _model(self, event: Any) -> None:
        if isinstance(event, AllBlocksCleared):
            self.cache.clear()
            return
        keys = [block_key(h) for h in event.block_hashes]
        if isinstance(event, BlockRemoved):
            for key in keys:
                self.cache[key] -= 1
                if self.cache[key] <= 0:
                    del self.cache[key]
        elif event.parent_block_hash is None and keys and keys[0] in self.cache:  # a report of hits
            for key in keys:
                self.cache[key] = max(self.cache[key], 1)
        else:
            for key in keys:
                self.cache[key] += 1


def stored(*ns: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=[digest(n) for n in ns],
                       parent_block_hash=None if parent is None else digest(parent),
                       token_ids=list(range(16 * len(ns))), block_size=16, lora_id=None, medium="GPU", lora_name=None)


def removed(*ns: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[digest(n) for n in ns], medium="GPU")


async def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
