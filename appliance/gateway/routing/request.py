"""What the router knows about one request: its prompt as text, rendered once from the already parsed body.

The routes validate the body with pydantic anyway; rendering the prompt from that parsed object means the JSON is
parsed once on the hot path. The rendering only has to be stable and prefix-preserving (a conversation's next turn
renders to the previous rendering plus more), not identical to the model's chat template.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway.routing.prefix_index import block_hashes

_MESSAGE_END = "\x1e"  # record separator: cannot be confused with the text of a message
_ROLE_END = "\x1f"


@dataclass
class Decision:
    """Why a replica was chosen: for the span attribute and the decision metrics."""

    replica: str
    score: float  # the chosen replica's weighted total (round robin: 0)
    decided_by: str  # the scorer that separated winner and runner-up, "tie_breaker:<name>", "index", "single"
    prefix_match: float | None = None  # the chosen replica's matched prefix share, when the prefix scorer ran


@dataclass
class RoutingRequest:
    """The prompt text; its block hashes are computed on first use and kept for retries."""

    prompt: str
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)
    decision: Decision | None = None

    def hashes(self, block_chars: int) -> list[int]:
        cached = self._hashes.get(block_chars)
        if cached is None:
            cached = self._hashes[block_chars] = block_hashes(self.prompt, block_chars)
        return cached


def render_chat(messages: Iterable[Any]) -> str:
    """The message sequence as one string: role and content of each message, in order."""
    parts = []
    for message in messages:
        parts.append(f"{message.role}{_ROLE_END}{_content_text(message.content)}{_MESSAGE_END}")
    return "".join(parts)


def render_completion(prompt: str | Sequence[Any]) -> str:
    """A completion prompt as one string: the text, or the texts / token ids joined."""
    if isinstance(prompt, str):
        return prompt
    ids = [item for item in prompt if isinstance(item, int)]
    if len(ids) == len(prompt):  # one prompt of token ids
        return _tokens_text(ids)
    return _MESSAGE_END.join(item if isinstance(item, str) else _tokens_text(item) for item in prompt)


def _tokens_text(tokens: Sequence[int]) -> str:
    return ",".join(str(token) for token in tokens) + ","


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    # Multi-part content: the text parts carry the prefix; other parts (images) are identified by what they hold.
    return _ROLE_END.join(str(part.get("text", part)) for part in content)
