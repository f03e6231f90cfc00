"""What a request may cost at most, before an engine has seen it: the quota reserves this (``quota.Reservation``)
and settles it to what the engine reports.

- Prompts: a completion's ``prompt`` may be several (texts, or lists of token ids); a chat request is one.
- Prompt tokens: token ids count as themselves; text is estimated at four characters a token (English text with a
  BPE tokenizer; the gateway has no tokenizer on its path). The engine's usage corrects the estimate at the end.
- Completion tokens, per prompt: ``max_tokens`` (chat: ``max_completion_tokens`` first) x ``n``; without it, what
  vLLM 0.32 would allow: 16 for a completion that leaves the key out (its default), the model's context less the
  prompt for a chat request or an explicit ``null``. Never more than the context leaves after the prompt.
- Requests: prompts x ``n``, each a sequence the engine runs.
"""

from __future__ import annotations

import math
from typing import Any

from appliance.gateway.tenants.quota import Cost

CHARS_PER_TOKEN = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM 0.32's CompletionRequest.max_tokens default


def estimate_prompt_tokens(prompt: str | None) -> int:
    """A prompt's tokens before the engine counts them: about four characters a token; at least 1."""
    if not prompt:
        return 1
    return max(1, math.ceil(len(prompt) / CHARS_PER_TOKEN))


def request_cost(route: str, body: dict[str, Any] | None, rendered: str, max_model_len: int | None) -> Cost:
    """The worst case of a request (``body``: the parsed JSON; ``rendered``: its prompt as the router renders
    it, for chat and for a body that did not parse)."""
    if body is None:
        return Cost(estimate_prompt_tokens(rendered), 0, 1)
    prompts = _prompt_tokens(route, body, rendered)
    n = _count(body.get("n"))
    limit = _max_tokens(route, body)
    completion = 0
    for tokens in prompts:
        room = None if max_model_len is None else max(0, max_model_len - tokens)
        each = (room or 0) if limit is None else limit if room is None else min(limit, room)
        completion += each * n
    return Cost(sum(prompts), completion, len(prompts) * n)


def _prompt_tokens(route: str, body: dict[str, Any], rendered: str) -> list[int]:
    """Each prompt's tokens (estimated for text)."""
    prompt = body.get("prompt") if route == "completions" else None
    if isinstance(prompt, str):
        return [estimate_prompt_tokens(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt):
            return [max(1, len(prompt))]
        return [max(1, len(item)) if isinstance(item, list) else estimate_prompt_tokens(str(item))
                for item in prompt]
    return [estimate_prompt_tokens(rendered)]


def _max_tokens(route: str, body: dict[str, Any]) -> int | None:
    """The completion limit the request sets per sequence (None: the context's room)."""
    if route == "chat":
        value = body.get("max_completion_tokens") or body.get("max_tokens")
    elif "max_tokens" not in body:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1
