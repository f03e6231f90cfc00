"""One replica's prefix cache as its engine's KV-cache events state it: block key -> copies held.

Copies, not a set: vLLM does not deduplicate blocks (kv_cache_utils' BlockHashToBlockMap), so the same block hash
can be cached in two blocks (a prompt ending on a block boundary recomputes its last block; chunked prefills of one
prompt side by side), and evicting one copy sends a BlockRemoved while the other still serves hits. A set would
forget the hottest prefixes first. A BlockStored from the root (no parent) whose first block is already held is a
report of blocks the engine holds, not new copies: vLLM sends those for a request's prefix-cache hits when it asks
for ``kv_cache_report_mode: full``, while a new chain is stored from the root only when its first block missed.
Such a report adds no copy (a block the index did not know is added once). The one store it miscounts, a prompt of
a single block computed again (its only block can never be a hit), counts one copy too few: the index may then
miss that block early, never claim it late.

The index never claims a block the engine no longer holds, as long as no event was lost: the subscriber
(``subscriber.py``) empties it and says so (``trusted_from``) whenever events may have been lost, and a bound on its
size (``max_blocks``) drops the oldest entries, which makes it miss, never lie. Memory: a dict entry of a 64-bit
int key and a small-int count, about 90 bytes per block (measured with tracemalloc in
tests/gateway/test_kv_events_index.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from appliance.gateway.routing.kv_events.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, block_key
from appliance.gateway.routing.kv_events.wire import counts as about_the_cache


class ReplicaIndex:
    """The blocks one engine holds, and how the events that built it went."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[int, int] = {}
        self.block_size: int | None = None  # tokens per block, from the engine's first BlockStored
        # When the index may be routed on (monotonic; None: not now). Set by the subscriber: at once when in step
        # with the engine's events, later after a loss it could not repair (the index then holds a subset).
        self.trusted_from: float | None = None
        self.received = 0  # events decoded
        self.applied = 0  # events about the engine's own cache, applied
        self.lost_batches = 0  # batches missed (sequence gaps, undecodable) that no replay brought back
        self.evicted = 0  # entries dropped to stay within max_blocks
        self.resets: Counter[str] = Counter()  # times the index was emptied, by reason
        self.last_applied_at: float | None = None  # monotonic
        self.last_lag_seconds: float | None = None  # the engine's publish time to here, for the last batch

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def copies(self, key: int) -> int:
        return self._blocks.get(key, 0)

    def snapshot(self) -> dict[int, int]:
        return dict(self._blocks)

    def usable(self, now: float) -> bool:
        return self.trusted_from is not None and now >= self.trusted_from

    def matched(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's blocks, in order) the engine holds from the first on."""
        blocks = self._blocks
        for held, key in enumerate(keys):
            if key not in blocks:
                return held
        return len(keys)

    def reset(self, reason: str) -> None:
        """Empty: the engine's cache is gone (a restart, AllBlocksCleared) or unknown (events lost)."""
        self._blocks = {}
        self.resets[reason] += 1

    def apply_batch(self, batch: Batch, now: float, wall_now: float) -> None:
        self.received += len(batch.events)
        for event in batch.events:
            if about_the_cache(event):
                self.apply(event)
                self.applied += 1
        self.last_applied_at = now
        self.last_lag_seconds = max(0.0, wall_now - batch.ts)

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        else:
            self.reset("all_blocks_cleared")

    def _store(self, event: BlockStored) -> None:
        if self.block_size is None:
            self.block_size = event.block_size
        blocks = self._blocks
        keys = [block_key(h) for h in event.block_hashes]
        if event.parent_block_hash is None and keys and keys[0] in blocks:  # a report of blocks held
            for key in keys:
                blocks.setdefault(key, 1)
        else:
            for key in keys:
                blocks[key] = blocks.get(key, 0) + 1
        while len(blocks) > self.max_blocks:
            del blocks[next(iter(blocks))]  # the oldest entry: insertion order
            self.evicted += 1

    def _remove(self, event: BlockRemoved) -> None:
        blocks = self._blocks
        for block_hash in event.block_hashes:
            key = block_key(block_hash)
            held = blocks.get(key)
            if held is None:
                continue  # stored before the index last started (a subset), or dropped by the bound
            if held <= 1:
                del blocks[key]
            else:
                blocks[key] = held - 1
