"""Which prompt prefixes were sent to which replica recently: the approximate prefix-cache index.

A prompt is cut into fixed-size blocks of characters and each block's hash is chained with the one before it, so a
block's hash stands for the whole prompt up to its end (as vLLM's own block hashes do, over tokens). Characters,
not tokens: the gateway has no tokenizer on its hot path, and the parsed request already holds ``str``, so
slicing it costs nothing while encoding to bytes would copy the prompt. Only full blocks are hashed; a prompt
shorter than one block never matches.

The index is one ``OrderedDict`` of keys ``(chain hash, replica slot)`` folded into one small int, in
least-recently-used order, bounded by a memory budget (``ENTRY_BYTES`` per key, measured: see
tests/gateway/test_routing_prefix_index.py and bench/prefix_routing.py). A replica that restarts gets a new slot,
so its old keys can never match again and age out first; forgetting costs O(1) instead of a scan.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

HASH_BITS = 44
SLOT_BITS = 16
_HASH_MASK = (1 << HASH_BITS) - 1
_SLOT_MASK = (1 << SLOT_BITS) - 1
# Per key: the OrderedDict's hash-table slot and linked-list node, plus the int key itself (60 bits: 32 bytes).
# Measured with tracemalloc on CPython 3.11: 107-148 bytes per key between 10k and 1.4M keys (the hash table
# grows by doubling, so it varies with the fill); 1M keys took 123 MB. The worst case, rounded up:
ENTRY_BYTES = 152


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained hashes of each full block of ``text``: element i covers ``text[: (i + 1) * block_chars]``.

    Python's ``hash`` of ``str`` is salted per process, which is fine: the index lives and dies with the process.
    """
    hashes = []
    previous = 0
    for end in range(block_chars, len(text) + 1, block_chars):
        previous = hash((previous, text[end - block_chars:end])) & _HASH_MASK
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Block hashes per replica, least recently used first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.capacity = max(1, budget_bytes // ENTRY_BYTES)
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def bytes(self) -> int:
        return len(self._keys) * ENTRY_BYTES

    def forget(self, replica: str) -> None:
        """The replica's engine lost its cache (restart): nothing recorded for it matches any more."""
        self._slots.pop(replica, None)

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt were recently sent to ``replica``."""
        slot = self._slots.get(replica)
        if slot is None:
            return 0
        keys = self._keys
        for i, block in enumerate(hashes):
            if (block << SLOT_BITS | slot) not in keys:
                return i
        return len(hashes)

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """``replica`` was sent a prompt with these blocks: make them its most recently used.

        Inserted last block first, so that the first blocks are the most recent: eviction then trims a prefix
        from its tail, as an engine's cache does, and never leaves a tail whose head is gone."""
        slot = self._slot(replica)
        keys = self._keys
        for block in reversed(hashes):
            key = block << SLOT_BITS | slot
            if key in keys:
                keys.move_to_end(key)
            else:
                keys[key] = None
        overflow = len(keys) - self.capacity
        for _ in range(max(0, overflow)):
            keys.popitem(last=False)
        if overflow > 0:
            self.evictions += overflow

    def _slot(self, replica: str) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            slot = self._slots[replica] = self._next_slot & _SLOT_MASK
            self._next_slot += 1
        return slot
