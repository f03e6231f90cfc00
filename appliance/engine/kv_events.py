"""Where a replica publishes its KV-cache events, and the flags that make its block hashes computable elsewhere.

vLLM publishes, per scheduler step, a batch of events (the blocks its prefix cache stored and removed, or all of
them cleared) on a ZeroMQ PUB socket, numbered, and keeps the last batches for replay on a ROUTER socket. The
gateway subscribes to keep an exact index of each engine's cache (appliance.gateway.routing.kv_events). Both
sockets are bound by the engine, at ports derived from the replica's own: its port + ``kv_events_port_offset`` and
+ ``kv_events_replay_port_offset``.

Bound, not connected: a PUB socket that connects to its subscriber drops the batches it sends before it has
processed the subscription, which libzmq does lazily (measured: the first batches after an idle spell were lost
every time); one that binds keeps none of that race. vLLM binds the PUB socket only for an endpoint that names a
wildcard (``*``) or contains ``::``; ``tcp://[::ffff:127.0.0.1]:port`` is the IPv4 loopback written as an
IPv4-mapped address, which libzmq binds as 127.0.0.1 only (checked in tests/engine/test_kv_events.py against
vLLM's own rule). The replay socket is always bound, so it takes the plain address.

The gateway hashes a prompt's blocks as the engine does: SHA-256 of pickled (parent hash, block tokens, extra
keys), chained from a first parent derived from PYTHONHASHSEED. ``random`` keeps Python's own string hashing
randomised in the engine (a fixed integer seed would not) while giving vLLM a known seed string.
"""

from __future__ import annotations

import json

from appliance.engine.settings import EngineSettings

HASH_ALGO = "sha256"  # vLLM --prefix-caching-hash-algo (its default, pinned so extra_args cannot change it)
HASH_SEED = "random"  # PYTHONHASHSEED of the engines: the seed string vLLM derives its first parent hash from
_LOOPBACK_BIND = "[::ffff:127.0.0.1]"  # see the module's docstring


def event_ports(port: int, engine: EngineSettings) -> tuple[int, int]:
    """The replica on ``port`` publishes on the first port and answers replay requests on the second."""
    return port + engine.kv_events_port_offset, port + engine.kv_events_replay_port_offset


def kv_events_config(port: int, engine: EngineSettings) -> dict[str, object] | None:
    """vLLM's KVEventsConfig for the replica on ``port`` (None: events off)."""
    if engine.kv_events == "off":
        return None
    events, replay = event_ports(port, engine)
    local = engine.kv_events == "local"
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://{_LOOPBACK_BIND if local else '*'}:{events}",
            "replay_endpoint": f"tcp://{'127.0.0.1' if local else '*'}:{replay}"}


def kv_events_argv(port: int, engine: EngineSettings) -> list[str]:
    config = kv_events_config(port, engine)
    if config is None:
        return []
    return ["--kv-events-config", json.dumps(config, separators=(",", ":")), "--prefix-caching-hash-algo", HASH_ALGO]


def kv_events_env(engine: EngineSettings) -> dict[str, str]:
    return {} if engine.kv_events == "off" else {"PYTHONHASHSEED": HASH_SEED}
