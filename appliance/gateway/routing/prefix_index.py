"""Which prompt prefixes were sent to which replica recently: the approximate prefix-cache index.

A prompt is cut into fixed-size blocks of characters and each block's hash is chained with the one before it, so a
block's hash stands for the whole prompt up to its end (as vLLM's own block hashes do, over tokens). Characters,
not tokens: the gateway has no tokenizer on its hot path, and the parsed request already holds ``str``, so
slicing it costs nothing while encoding to bytes would copy the prompt. Only full blocks are hashed; a prompt
shorter than one block never matches.

Per replica, the index models that replica's engine cache: one ``OrderedDict`` of block hashes in least-recently-
used order, holding no more blocks than the engine's KV cache can (its capacity, once the engine's /metrics told
it: ``set_capacity``), evicted least recently used first, as vLLM evicts freed prefix blocks. Without that bound
the index would remember what the gateway sent long after the engine evicted it, and keep sending conversations
back to a replica that no longer holds them. Until a replica's capacity is known, only the memory
budget applies.

The memory budget (``ENTRY_BYTES`` per block and replica, measured: see tests/gateway/test_routing_prefix_index.py
and bench/prefix_routing.py) bounds all replicas together: the gateway's own memory, not a model of any engine.
When it binds, blocks are evicted from the replica that holds the most (its least recent first), so the budget is
shared evenly (max-min) rather than lost to one replica's traffic. A replica that restarts is forgotten at once:
its blocks are freed and its capacity is read again from its new engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

HASH_BITS = 44
_HASH_MASK = (1 << HASH_BITS) - 1
# Per key: the OrderedDict's hash-table slot and linked-list node, plus the int key itself (44 bits: 32 bytes).
# Measured with tracemalloc on CPython 3.11: 107-148 bytes per key between 10k and 1.4M keys (the hash table
# grows by doubling, so it varies with the fill); 1M keys took 123 MB. The worst case, rounded up:
ENTRY_BYTES = 152


def block_hashes(text: str, block_chars: int, salt: str = "") -> list[int]:
    """Chained hashes of each full block of ``text``: element i covers ``text[: (i + 1) * block_chars]``.

    ``salt`` starts the chain, as vLLM's ``cache_salt`` enters its first block's hash: the same prompt under two
    salts shares no block, in the engine's cache and so in this index (the gateway salts each tenant's prompts).
    Python's ``hash`` of ``str`` is salted per process, which is fine: the index lives and dies with the process.
    """
    hashes = []
    previous = hash(salt) & _HASH_MASK if salt else 0
    for end in range(block_chars, len(text) + 1, block_chars):
        previous = hash((previous, text[end - block_chars:end])) & _HASH_MASK
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Block hashes per replica, least recently used first, within each replica's capacity and ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(1, budget_bytes // ENTRY_BYTES)  # blocks, all replicas together
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}  # blocks per replica, where its engine's cache size is known
        self._size = 0
        self.evictions = 0

    def __len__(self) -> int:
        return self._size

    @property
    def bytes(self) -> int:
        return self._size * ENTRY_BYTES

    def held(self, replica: str) -> int:
        """Blocks recorded for ``replica`` (what the index believes its engine's cache holds)."""
        blocks = self._blocks.get(replica)
        return 0 if blocks is None else len(blocks)

    def capacity_of(self, replica: str) -> int | None:
        return self._capacity.get(replica)

    def set_capacity(self, replica: str, blocks: int | None) -> None:
        """The replica's engine holds at most ``blocks`` of the index's blocks (None: unknown, only the budget
        bounds it). A smaller capacity evicts its least recent blocks at once."""
        if blocks is None:
            self._capacity.pop(replica, None)
            return
        self._capacity[replica] = max(0, blocks)
        self._trim(replica)

    def forget(self, replica: str) -> None:
        """The replica's engine lost its cache (restart): its blocks are freed, and its capacity is unknown until
        the new engine reports it."""
        blocks = self._blocks.pop(replica, None)
        if blocks is not None:
            self._size -= len(blocks)
        self._capacity.pop(replica, None)

    def retain(self, live: Collection[str]) -> None:
        """Forget every replica not in ``live`` (gone from the fleet), as ``forget`` does one."""
        for replica in [name for name in {*self._blocks, *self._capacity} if name not in live]:
            self.forget(replica)

    def replicas(self) -> set[str]:
        """The replicas the index keeps anything of."""
        return {*self._blocks, *self._capacity}

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt the replica's cache is believed to hold."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        for i, block in enumerate(hashes):
            if block not in blocks:
                return i
        return len(hashes)

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """``replica`` was sent a prompt with these blocks: make them its most recently used.

        Inserted last block first, so that the first blocks are the most recent: eviction then trims a prefix
        from its tail, as an engine's cache does, and never leaves a tail whose head is gone."""
        blocks = self._blocks.get(replica)
        if blocks is None:
            blocks = self._blocks[replica] = OrderedDict()
        before = len(blocks)
        for block in reversed(hashes):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        self._size += len(blocks) - before
        self._trim(replica)
        self._trim_budget()

    def _trim(self, replica: str) -> None:
        capacity = self._capacity.get(replica)
        blocks = self._blocks.get(replica)
        if capacity is None or blocks is None:
            return
        self._evict(blocks, len(blocks) - capacity)

    def _trim_budget(self) -> None:
        """Over the budget: evict from the replica holding the most, down towards the runner-up, in turn. O(replicas)
        per step, and a step takes as many blocks as it can; the budget binds rarely (it is sized for memory)."""
        while self._size > self.budget:
            ordered = sorted(self._blocks.values(), key=len, reverse=True)
            runner_up = len(ordered[1]) if len(ordered) > 1 else 0
            self._evict(ordered[0], min(self._size - self.budget, max(1, len(ordered[0]) - runner_up)))

    def _evict(self, blocks: OrderedDict[int, None], count: int) -> None:
        for _ in range(max(0, count)):
            blocks.popitem(last=False)
        if count > 0:
            self._size -= count
            self.evictions += count
