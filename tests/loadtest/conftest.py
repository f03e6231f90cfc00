"""Fixtures for the load tester's tests: fake engines (tests/fake_engine.py) on 127.0.0.1, stopped after each test;
Meta-Llama-3-8B's config.json for the planner's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_engine import CountingModel, FakeEngine

# The engine these tests assume unless they say otherwise: it serves "stub", 10 ms to the first token and 2 ms
# between tokens, counts a prompt as a BOS token and one a word, has no /tokenize (the load tester then counts words
# itself) and reports a steady 20 % KV-cache usage.
DEFAULTS: dict[str, Any] = {"served_model_name": "stub", "model": CountingModel(words=True), "first_token_delay": 0.01,
                            "token_delay": 0.002, "tokenize_endpoint": False, "kv_cache_usage": 0.2}


@pytest.fixture
def stub_server() -> Iterator[Callable[..., FakeEngine]]:
    """Call it with FakeEngine's fields (over DEFAULTS) to get a started engine."""
    engines: list[FakeEngine] = []

    def start(**kwargs: Any) -> FakeEngine:
        engine = FakeEngine(**{**DEFAULTS, **kwargs}).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.stop()


# Meta-Llama-3-8B's published config.json (the fields memory depends on, as published).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "attention_bias": False,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}


@pytest.fixture
def llama_config(tmp_path: Path) -> Path:
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA3_8B))
    return path
