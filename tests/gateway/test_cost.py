"""A request's worst case, before an engine has seen it: what the tenant's quota reserves."""

from __future__ import annotations

import pytest

from appliance.gateway.tenants.cost import estimate_prompt_tokens, request_cost
from appliance.gateway.tenants.quota import Cost


def test_prompt_estimate_is_positive():
    assert estimate_prompt_tokens(None) == 1
    assert estimate_prompt_tokens("") == 1
    assert estimate_prompt_tokens("x" * 400) == 100


@pytest.mark.parametrize(("route", "body", "expected"), [
    ("completions", {"prompt": "x" * 40, "max_tokens": 10}, Cost(10, 10, 1)),
    ("completions", {"prompt": "x" * 40}, Cost(10, 16, 1)),  # vLLM's completions default
    ("completions", {"prompt": "x" * 40, "max_tokens": None}, Cost(10, 90, 1)),  # null: the context's room
    ("completions", {"prompt": "x" * 40, "max_tokens": 10, "n": 3}, Cost(10, 30, 3)),
    ("completions", {"prompt": ["x" * 40, "y" * 80], "max_tokens": 10, "n": 2}, Cost(30, 40, 4)),
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 5}, Cost(3, 5, 1)),  # token ids count as themselves
    ("completions", {"prompt": [[1, 2], [3, 4, 5, 6]], "max_tokens": 5}, Cost(6, 10, 2)),
    ("completions", {"prompt": "x" * 40, "max_tokens": 500}, Cost(10, 90, 1)),  # never past the context
    ("chat", {"messages": [], "max_tokens": 7}, Cost(10, 7, 1)),
    ("chat", {"messages": [], "max_completion_tokens": 5, "max_tokens": 7}, Cost(10, 5, 1)),
    ("chat", {"messages": [], "n": 2}, Cost(10, 180, 2)),  # no limit: the context less the prompt, each choice
])
def test_the_worst_case_is_the_prompt_and_max_tokens_times_n_for_each_prompt(route, body, expected):
    assert request_cost(route, body, "r" * 40, max_model_len=100) == expected


def test_without_a_body_only_the_rendered_prompt_is_known():
    assert request_cost("chat", None, "r" * 40, max_model_len=100) == Cost(10, 0, 1)
