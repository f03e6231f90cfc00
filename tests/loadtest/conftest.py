"""Fixtures for the load tester's tests: fake engines (tests/fake_engine.py) on 127.0.0.1, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
