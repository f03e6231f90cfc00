"""Client JSON parsed so that a hostile body is a clear 400, never a crash: the standard library's decoder
recurses, so a body of 100,000 opening brackets raises RecursionError (not a ValueError) and would be a 500."""

from __future__ import annotations

import json
from typing import Any


class InvalidJSON(ValueError):
    """The body is not JSON the appliance will parse; the message says why."""


def loads(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidJSON("JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidJSON(str(exc)) from None
