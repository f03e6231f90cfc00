"""The exchange's view of the body: parsed once (or given parsed by the route), changed by ``override`` in step
with the bytes the engine gets, and None for a body that is not a JSON object."""

from __future__ import annotations

import json
import time

import pytest

from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.upstream.exchange import Exchange
from tests.gateway.upstream.support import request


def _exchange(body: bytes, parsed: dict | None = None) -> Exchange:
    return Exchange(route="completions", path="/v1/completions", body=body, stream=True, arrived=time.monotonic(),
                    headers={}, request=request(), routing=RoutingRequest("hi"), parsed_body=parsed)


def test_a_body_given_parsed_is_not_parsed_again():
    given = {"prompt": "hi"}
    exchange = _exchange(b'{"prompt": "hi"}', given)
    exchange.body = b"not parsed again"  # what a parse would now fail on
    assert exchange.parsed() is given


def test_override_changes_the_given_dict_and_the_bytes_alike():
    given = {"prompt": "hi", "stream": True}
    exchange = _exchange(b'{"prompt": "hi", "stream": true}', given)
    exchange.override("stream_options", {"include_usage": True})
    assert given["stream_options"] == {"include_usage": True}
    assert json.loads(exchange.body) == given


def test_without_a_given_dict_the_body_is_parsed_on_first_use():
    exchange = _exchange(b'{"prompt": "hi"}')
    first = exchange.parsed()
    assert first == {"prompt": "hi"}
    assert exchange.parsed() is first


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"5", b"{not json", b""])
def test_a_body_that_is_not_an_object_reads_as_none(body):
    exchange = _exchange(body)
    assert exchange.parsed() is None
    exchange.override("stream_options", {"include_usage": True})  # nothing to set it in: the bytes stay
    assert exchange.body == body
