"""The engines' KV-event flags: vLLM's own config accepts them, its publisher binds where they say (loopback only
for ``local``), and the block hash is pinned so the gateway can compute it."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import ZmqEventPublisher

from appliance.engine.command import engine_argv, engine_env
from appliance.engine.kv_events import HASH_SEED, event_ports, kv_events_config
from appliance.engine.placement import Placement
from appliance.engine.settings import EngineSettings
from tests.gateway.kv_engine import free_port


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_off_by_default_and_then_nothing_changes():
    argv = engine_argv(Path("/m"), "demo", 8100, EngineSettings())
    assert "--kv-events-config" not in argv and "--prefix-caching-hash-algo" not in argv
    assert "PYTHONHASHSEED" not in engine_env(Placement(device="cpu", cores=(0,)), EngineSettings())


def test_local_events_are_bound_on_loopback_at_ports_derived_from_the_replicas():
    engine = EngineSettings(kv_events="local", kv_events_port_offset=1000, kv_events_replay_port_offset=2000)
    argv = engine_argv(Path("/m"), "demo", 8101, engine)
    config = KVEventsConfig(**json.loads(flag(argv, "--kv-events-config")))  # vLLM's own parser takes it
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert config.endpoint == "tcp://[::ffff:127.0.0.1]:9101" and config.replay_endpoint == "tcp://127.0.0.1:10101"
    assert ZmqEventPublisher._is_bind_endpoint(config.endpoint)  # vLLM binds it rather than connecting
    assert flag(argv, "--prefix-caching-hash-algo") == "sha256"
    assert engine_env(Placement(device="cpu", cores=(0,)), engine)["PYTHONHASHSEED"] == HASH_SEED
    assert event_ports(8101, engine) == (9101, 10101)


def test_network_events_are_bound_on_every_interface():
    config = kv_events_config(8100, EngineSettings(kv_events="network"))
    assert config is not None
    assert config["endpoint"] == "tcp://*:9100" and config["replay_endpoint"] == "tcp://*:10100"


def test_vllms_publisher_listens_on_loopback_only_for_local():
    port, replay = free_port(), free_port()
    engine = EngineSettings(kv_events="local", kv_events_port_offset=1, kv_events_replay_port_offset=2)
    config = kv_events_config(port - 1, engine)
    assert config is not None
    publisher = ZmqEventPublisher(0, endpoint=str(config["endpoint"]), replay_endpoint=f"tcp://127.0.0.1:{replay}")
    try:
        listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", port) in listening and ("127.0.0.1", replay) in listening
        assert not any(addr.port == port and addr.ip != "127.0.0.1" for addr in listening)
    finally:
        publisher.shutdown()


def test_the_flags_kv_events_owns_cannot_come_from_extra_args():
    with pytest.raises(ValueError, match="kv_events sets --kv-events-config"):
        EngineSettings(kv_events="local", extra_args=["--kv-events-config", "{}"])
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo"):
        EngineSettings(kv_events="network", extra_args=["--prefix-caching-hash-algo=xxhash"])
    with pytest.raises(ValueError, match="must differ"):
        EngineSettings(kv_events="local", kv_events_port_offset=5, kv_events_replay_port_offset=5)
    EngineSettings(extra_args=["--prefix-caching-hash-algo=xxhash"])  # events off: the operator's own business
