"""vLLM's KV-cache event batches as they come off the wire (vllm/distributed/kv_events.py), decoded without vLLM.

The gateway does not import vLLM (it pulls in torch: seconds and gigabytes). These structs mirror the publisher's:
a batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event a map tagged by its class name
(``type``). Fields the gateway does not read are left out (msgspec skips unknown fields), so a vLLM that adds
fields still decodes; an event of a kind this module does not know makes the batch undecodable as a whole, which
the subscriber treats as lost events (never silently skipped: a skipped removal would leave a stale block).

Block hashes are ``bytes`` (the SHA-256 digest) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its low 64 bits as an
int; ``block_key`` maps both to that int, the index's key.
"""

from __future__ import annotations

import msgspec

MEDIUM_GPU = "GPU"  # the engine's own KV cache; CPU and STORAGE are offloading tiers, not a prefix-cache hit
_LOW64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True):
    ts: float  # the engine's wall clock when it published the batch
    events: list[Event]
    data_parallel_rank: int | None = None


class BatchHead(msgspec.Struct, array_like=True):
    """A batch's timestamp alone: enough to tell a batch already applied from another with the same number."""

    ts: float


_BATCH = msgspec.msgpack.Decoder(Batch)
_HEAD = msgspec.msgpack.Decoder(BatchHead)
DecodeError = (msgspec.DecodeError, msgspec.ValidationError)


def decode(payload: bytes) -> Batch:
    """Raises one of ``DecodeError``."""
    return _BATCH.decode(payload)


def timestamp(payload: bytes) -> float:
    return _HEAD.decode(payload).ts


def block_key(block_hash: bytes | int) -> int:
    """The low 64 bits of a block hash, as vLLM's int form of it (``maybe_convert_block_hash``)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & _LOW64


def counts(event: Event) -> bool:
    """Whether the event is about the engine's own cache (not an offloading tier)."""
    return isinstance(event, AllBlocksCleared) or event.medium in (None, MEDIUM_GPU)
