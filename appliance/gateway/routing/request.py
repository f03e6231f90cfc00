"""What the router knows about one request: its prompt as text, rendered once from the already parsed body.

The routes validate the body with pydantic anyway; rendering the prompt from that parsed object means the JSON is
parsed once on the hot path. The rendering only has to be stable and prefix-preserving (a conversation's next turn
renders to the previous rendering plus more), not identical to the model's chat template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.gateway.routing.prefix_index import block_hashes

if TYPE_CHECKING:
    from appliance.gateway.routing.kv_events.tokens import PromptTokens

_MESSAGE_END = "\x1e"  # record separator: cannot be confused with the text of a message
_ROLE_END = "\x1f"


@dataclass(slots=True)
class Decision:
    """Why a replica was chosen: for the span attribute, the decision metrics and the request record.

    The explanation (every replica considered, the filter that removed each one left out, every scorer's value
    for the rest) is kept as the lists and the dict the router computed anyway, aligned by position: it is made
    on every request, and read only when an operator asks (``to_json``), so the dicts keyed by replica are built
    then, not here.
    """

    replica: str
    score: float  # the chosen replica's weighted total (round robin: 0)
    decided_by: str  # the scorer that separated winner and runner-up, "tie_<name>", "index", "single", ...
    prefix_match: float | None = None  # the chosen replica's matched prefix share, when the prefix scorer ran
    considered: list[str] = field(default_factory=list)  # every replica the router had, in its order
    removed: list[tuple[str, str]] = field(default_factory=list)  # (replica, first filter that removed it)
    scored: list[str] = field(default_factory=list)  # the candidates that reached the policy, in order
    scores: dict[str, list[float | None]] = field(default_factory=dict)  # scorer -> unweighted, as ``scored``
    totals: list[float] = field(default_factory=list)  # weighted totals, as ``scored`` (round robin: none)

    def removed_by(self) -> dict[str, str]:
        """Replica -> the name of the filter (or ``balance``) that left it out."""
        return dict(self.removed)

    def scores_by_replica(self) -> dict[str, dict[str, float | None]]:
        """Replica -> scorer -> its unweighted score (None: the scorer could not tell; neutral in the total).
        Empty for a policy without scorers (round robin)."""
        if not self.scores:
            return {}
        return {name: {scorer: values[i] for scorer, values in self.scores.items()}
                for i, name in enumerate(self.scored)}

    def to_json(self) -> dict[str, Any]:
        """The decision explained, JSON-ready: candidates (all considered), removed {replica: filter}, scores
        {replica: {scorer: value}}, totals {replica: weighted total}, picked, decided_by, total."""
        return {"candidates": list(self.considered), "removed": self.removed_by(),
                "scores": self.scores_by_replica(), "totals": dict(zip(self.scored, self.totals, strict=False)),
                "picked": self.replica, "decided_by": self.decided_by, "total": self.score,
                "prefix_match": self.prefix_match}


@dataclass
class RoutingRequest:
    """The prompt text; its block hashes are computed on first use and kept for retries. ``salt``: the prefix
    cache the engine will look the prompt up in (the tenant's ``cache_salt``, set before routing; empty: the
    shared cache), so that prefix affinity only counts on hits that can happen."""

    prompt: str
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)
    decision: Decision | None = None
    salt: str = ""
    # Precise prefix routing (appliance/gateway/routing/kv_events): the prompt as the engine tokenizes it, when
    # known, and the work that fills it, which the transport awaits before the request is routed.
    tokens: PromptTokens | None = None
    preparing: asyncio.Future[None] | None = None

    def hashes(self, block_chars: int) -> list[int]:
        cached = self._hashes.get(block_chars)
        if cached is None:
            cached = self._hashes[block_chars] = block_hashes(self.prompt, block_chars, self.salt)
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
