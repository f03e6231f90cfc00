"""A request's shape: a digest of what makes it reproduce on an engine.

Two requests of one shape make an engine compute the same thing: the route (completions or chat), the model, the
prompt or messages and every parameter that changes the computation (sampling, max_tokens, logprobs, structured
outputs, tools ...). What only changes how the answer is delivered or accounted is left out: streaming and its
options, the caller's user and request ids, the scheduling priority, and the token ids the gateway itself asks for
(migration adds ``return_token_ids``). The list of what is left out is closed on purpose: a parameter the gateway
does not know stays in the digest, so two requests it cannot tell apart are never taken for one shape (the cost of
a parameter wrongly kept is a breaker that opens for fewer requests, never one that refuses a different request).

The digest is a 16-byte BLAKE2b of a canonical encoding of the kept keys, sorted, and their values (objects by
sorted key, every string and container length-prefixed, so no two bodies encode alike): key order and whitespace in
the client's bytes do not matter. It is computed from the body the route already parsed, without re-serializing
its strings (a 1 MB prompt costs about a millisecond), and only while some shape is remembered or one failed.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping
from typing import Any

# Fields that never change what the engine computes for a request.
DELIVERY_ONLY = frozenset({"stream", "stream_options", "user", "request_id", "priority", "return_token_ids"})


def shape_of(route: str, body: Mapping[str, Any]) -> bytes:
    """The shape of a request to ``route`` with this (parsed) body."""
    digest = hashlib.blake2b(route.encode(), digest_size=16)
    _feed(digest, {key: value for key, value in body.items() if key not in DELIVERY_ONLY})
    return digest.digest()


def _feed(digest: Any, value: Any) -> None:
    """``value`` (parsed JSON) into the digest, canonically: strings as their UTF-8 bytes and lists of numbers as
    compact JSON, both in C; objects and other lists element by element (a body has few of those)."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        digest.update(b"s%d:" % len(data))
        digest.update(data)
    elif isinstance(value, dict):
        digest.update(b"d%d:" % len(value))
        for key in sorted(value):
            _feed(digest, str(key))
            _feed(digest, value[key])
    elif isinstance(value, list):
        numbers = _integers(value)
        if numbers is not None:  # token ids: one C call for the whole list
            digest.update(b"n%d:" % len(numbers))
            digest.update(numbers)
            return
        digest.update(b"l%d:" % len(value))
        for item in value:
            _feed(digest, item)
    else:  # a number, a boolean, null
        digest.update(b"v" + json.dumps(value).encode() + b";")


def _integers(value: list[Any]) -> bytes | None:
    """A list of integers that starts with one (token ids) as 64-bit bytes, converted in C; None for any other
    list (a float, a string, an integer past 64 bits). A boolean after the first element reads as 0 or 1: two
    bodies that differ only so (neither valid for vLLM) share a shape."""
    if not value or type(value[0]) is not int:
        return None
    try:
        return array("q", value).tobytes()
    except (TypeError, OverflowError):
        return None
