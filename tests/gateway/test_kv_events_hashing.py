"""The gateway's block hashes are the engine's: checked against vLLM's own hasher, on vLLM's own Request."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from appliance.engine.kv_events import HASH_SEED
from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.wire import block_key


def vllm_keys(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """What the engine computes for a request with these tokens (and publishes in its BlockStored events)."""
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=kv_cache_utils.get_request_block_hasher(block_size, sha256))
    return [block_key(kv_cache_utils.maybe_convert_block_hash(h)) for h in request.block_hashes]


@pytest.fixture(autouse=True)
def _vllms_seed_restored():
    """vLLM keeps its first parent hash in a module global (set by init_none_hash): put back what was there."""
    saved = getattr(kv_cache_utils, "NONE_HASH", None), kv_cache_utils._NONE_HASH_SEED
    yield
    if saved[0] is not None:
        kv_cache_utils.NONE_HASH = saved[0]
    kv_cache_utils._NONE_HASH_SEED = saved[1]


@pytest.fixture
def engine_seed(monkeypatch: pytest.MonkeyPatch) -> str:
    """vLLM's NONE_HASH as an engine the appliance starts derives it (PYTHONHASHSEED=random)."""
    monkeypatch.setenv("PYTHONHASHSEED", HASH_SEED)
    kv_cache_utils.init_none_hash(sha256)
    return HASH_SEED


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("salt", [None, "3f9c0a", "a salt with spaces"])
def test_the_keys_are_vllms_for_the_same_tokens(engine_seed: str, block_size: int, salt: str | None):
    rng = random.Random(block_size)
    hasher = BlockHasher(engine_seed)
    for length in (0, block_size - 1, block_size, 5 * block_size + 3, 300):
        tokens = [rng.randrange(0, 200_000) for _ in range(length)]
        assert hasher.keys(tokens, block_size, salt) == vllm_keys(tokens, block_size, salt), (length, salt)


def test_the_salt_changes_the_first_block_and_so_every_block(engine_seed: str):
    hasher = BlockHasher(engine_seed)
    tokens = list(range(64))
    plain, salted = hasher.keys(tokens, 16), hasher.keys(tokens, 16, "tenant-a")
    assert not set(plain) & set(salted)


def test_an_engine_without_a_seed_uses_vllms_default_seed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(sha256)
    tokens = list(range(100, 180))
    assert BlockHasher(kv_cache_utils.DEFAULT_NONE_HASH_SEED).keys(tokens, 16) == vllm_keys(tokens, 16, None)
    assert BlockHasher(HASH_SEED).keys(tokens, 16) != vllm_keys(tokens, 16, None)  # the seed matters


def test_int_block_hashes_give_the_same_keys(monkeypatch: pytest.MonkeyPatch):
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: events carry the hash's low 64 bits as an int."""
    digest = sha256(("x", (1, 2, 3), None))
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    as_int = kv_cache_utils.maybe_convert_block_hash(kv_cache_utils.BlockHash(digest))
    assert isinstance(as_int, int)
    assert block_key(as_int) == block_key(digest)
