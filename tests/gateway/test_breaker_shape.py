"""A request's shape: what makes it reproduce is in the digest, how it is delivered is not."""

from __future__ import annotations

import json

import pytest

from appliance.gateway.breaker.shape import shape_of

BASE = {"model": "demo", "prompt": "hello", "max_tokens": 8, "temperature": 0.7,
        "structured_outputs": {"json": {"type": "array", "minItems": 1}}}


def test_key_order_whitespace_and_delivery_do_not_change_the_shape():
    reordered = json.loads(json.dumps(dict(reversed(list(BASE.items())))))
    delivered = {**BASE, "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
                 "request_id": "r1", "priority": -5, "return_token_ids": True}
    assert shape_of("completions", reordered) == shape_of("completions", BASE) == shape_of("completions", delivered)


@pytest.mark.parametrize("change", [
    {"prompt": "hello!"}, {"model": "other"}, {"max_tokens": 9}, {"temperature": 0.0}, {"seed": 1},
    {"structured_outputs": {"json": {"type": "array", "minItems": 2}}}, {"logprobs": 2}, {"some_new_field": 1},
])
def test_what_changes_the_computation_changes_the_shape(change):
    assert shape_of("completions", {**BASE, **change}) != shape_of("completions", BASE)


def test_the_route_is_part_of_the_shape():
    assert shape_of("chat", BASE) != shape_of("completions", BASE)


def test_a_shape_is_sixteen_bytes():
    assert len(shape_of("chat", {"messages": [{"role": "user", "content": "x" * 100_000}]})) == 16


@pytest.mark.parametrize("one,other", [
    ([1, 2, 3], [1, 2, 4]), ([1, 2], [[1, 2]]), ([1, 2], [1.0, 2]), ([1, 2], ["1", 2]), (["ab", "c"], ["a", "bc"]),
    ([2**70], [2**70 + 1]), ("", []), ({"a": "b"}, ["a", "b"]),
])
def test_prompts_that_differ_have_different_shapes(one, other):
    """Token ids, texts, nested lists: each encoding is length-prefixed and typed, so no two differ only in form."""
    assert shape_of("completions", {"prompt": one}) != shape_of("completions", {"prompt": other})
