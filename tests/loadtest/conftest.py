"""Fixtures for the load tester's tests: stub OpenAI servers on 127.0.0.1, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.loadtest.stub import StubServer


@pytest.fixture
def stub_server() -> Iterator[Callable[..., StubServer]]:
    """Call it with StubServer's fields to get a started server."""
    servers: list[StubServer] = []

    def start(**kwargs: object) -> StubServer:
        server = StubServer(**kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
