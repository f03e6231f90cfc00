"""Schemathesis fuzzes the gateway's OpenAPI schema against real engines: no 5xx, no hang.

Driven through hypothesis directly (schemathesis' pytest plugin does not support this pytest release).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.engine

EXAMPLES_PER_OPERATION = 40


def check(case, base_url: str) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 16)  # short generations; limits are tested apart
    response = case.call(base_url=base_url, timeout=30)  # a hang fails here
    assert response.status_code < 500, (f"{case.method} {case.path} {case.body!r} -> {response.status_code} "
                                        f"{response.text[:300]}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and "type" in error


def test_no_server_error_and_no_hang(appliance):
    schema = schemathesis.openapi.from_url(f"{appliance.url}/openapi.json").include(path_regex="^/v1/")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def fuzz(case) -> None:
            check(case, appliance.url)

        fuzz()
