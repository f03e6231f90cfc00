"""A prompt's block hashes computed as vLLM computes them (v1/core/kv_cache_utils.py, hash_block_tokens with the
sha256 hash of vllm/utils/hashing.py), so that they can be looked up among the hashes the engine's events carry.

Block i's hash is SHA-256 over the pickle (highest protocol) of ``(parent, tokens of block i, extra keys)``, where
parent is block i-1's hash and, for block 0, ``NONE_HASH``: SHA-256 of the pickled seed string (the engine's
PYTHONHASHSEED, or ``vllm-none-hash`` when unset). Only full blocks are hashed. The extra keys are None except
block 0's when the request has a ``cache_salt``: ``(("cache_salt", salt),)``. LoRA adapters, multimodal inputs and
prompt embeddings add keys of their own; the gateway routes none of those precisely (``tokens.py``).

tests/gateway/test_kv_events_hashing.py checks the result against vLLM's own hasher on a vLLM ``Request``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from appliance.gateway.routing.kv_events.wire import block_key

_PROTOCOL = pickle.HIGHEST_PROTOCOL  # what vLLM's sha256 pickles with (same interpreter: the same protocol)


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PROTOCOL)).digest()


class BlockHasher:
    """Chained block hashes of token sequences, for engines that seed their first block with ``seed``."""

    def __init__(self, seed: str) -> None:
        self.none_hash = _sha256(seed)

    def keys(self, tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
        """The index key (``wire.block_key``) of each full block of ``tokens``, in order."""
        keys = []
        parent = self.none_hash
        extra: tuple[tuple[str, str], ...] | None = (("cache_salt", salt),) if salt else None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = _sha256((parent, tuple(tokens[start:start + block_size]), extra))
            extra = None
            keys.append(block_key(parent))
        return keys
