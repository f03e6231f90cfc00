"""``routing.prefix_cache``: how the router knows what each engine's prefix cache holds."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PrefixCacheMode = Literal["approximate", "precise", "precise-with-fallback"]


class PrefixCacheSettings(BaseModel):
    """approximate: the gateway's model of what it sent where (``routing.scorers.prefix``); precise: each engine's
    own KV-cache events, with the prompt tokenized and hashed as the engine does; precise-with-fallback: precise
    for every replica whose event index is current, approximate for the others."""

    model_config = ConfigDict(extra="forbid")

    mode: PrefixCacheMode = Field(
        "approximate", description="approximate, precise or precise-with-fallback (docs/tuning.md section 5)."
    )
    tokenizer: Path | None = Field(
        None, description="Directory of the served model's tokenizer (tokenizer.json, tokenizer_config.json with "
        "its chat template), read offline; default: `model`."
    )
    hash_seed: str = Field(
        "random", description="The engines' PYTHONHASHSEED as vLLM reads it (the seed of a prompt's first block "
        "hash). Engines the appliance runs with engine.kv_events get `random`."
    )
    index_max_blocks: int = Field(
        262_144, ge=1024, description="Blocks the event index holds per replica (about 90 bytes each). An engine "
        "holds at most its num_gpu_blocks; beyond this bound the oldest entries go (the index then misses them, "
        "never claims a block the engine evicted)."
    )
    replay_timeout_seconds: float = Field(
        2.0, gt=0, description="How long a replay of missed event batches may take before the replica's index is "
        "started again empty."
    )
    resync_seconds: float = Field(
        30.0, ge=0, description="After events were lost and could not be replayed, the replica's index starts "
        "again empty: for this long it counts as unknown (the approximate scorer decides for that replica in "
        "precise-with-fallback), then it is used although blocks stored before the loss stay unknown to it."
    )
    tokenizer_threads: int = Field(
        2, ge=1, le=32, description="Threads that tokenize prompts off the event loop (each holds its own "
        "tokenizer)."
    )
    max_pending_tokenizations: int = Field(
        64, ge=1, description="Prompts being tokenized at once; a request beyond it is routed on the approximate "
        "scorer instead of waiting."
    )
