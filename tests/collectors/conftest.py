from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.collectors.support import EngineTree, engine_tree_fixture


@pytest.fixture(scope="session")
def idle_tree() -> Iterator[EngineTree]:
    """A replica-shaped process tree whose engine core sleeps; shared, so tests must not change it."""
    yield from engine_tree_fixture(busy=False)


@pytest.fixture
def fresh_tree() -> Iterator[EngineTree]:
    """An idle replica-shaped tree of the test's own, for tests that kill part of it."""
    yield from engine_tree_fixture(busy=False)


@pytest.fixture
def busy_tree() -> Iterator[EngineTree]:
    """A replica-shaped process tree whose engine core spins on one core."""
    yield from engine_tree_fixture(busy=True)
