"""The JSONL formats: an input file read into request lines, and each line's result as OpenAI writes it.

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url", "body"}``. What is wrong with the batch
as a whole is refused when it is created (400 with OpenAI's error JSON, nothing stored): a ``url`` other than the
batch's endpoint, a method other than POST, a model this appliance does not serve, a ``custom_id`` used twice, more
lines than ``batch.max_lines``, no line at all. What is wrong with one line only (not JSON, no ``custom_id``, a
body the route would refuse) fails that line: its error goes to the error file and the rest run.

Output: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; 2xx answers go to
the output file, every other answer and every line that got none (malformed, expired, cancelled) to the error
file, with ``response`` null and ``error`` ``{code, message}`` for the latter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from appliance.batch.model import ENDPOINTS, ERROR, OUTPUT, LineInput, LineResult, PendingLine, Usage, line_request_id
from appliance.gateway.routing.request import render_chat, render_completion
from appliance.gateway.schemas import ChatCompletionRequest, CompletionRequest
from appliance.http.errors import APIError

MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Rules:
    """What a batch's lines are checked against."""

    endpoint: str
    served_model: str | None
    max_model_len: int | None
    max_lines: int


def read_lines(data: bytes, rules: Rules, batch_id: str) -> list[LineInput]:
    """The input file's request lines (blank lines skipped), each checked; raises APIError(400) when the batch as
    a whole cannot be run."""
    lines: list[LineInput] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) >= rules.max_lines:
            raise APIError(400, f"the file holds more than {rules.max_lines} request lines (batch.max_lines)",
                           param="input_file_id", code="too_many_lines")
        line = _read_line(raw, number, rules, batch_id)
        if line.custom_id is not None:
            if line.custom_id in seen:
                raise APIError(400, f"line {number}: custom_id {line.custom_id!r} is already used on line "
                                    f"{seen[line.custom_id]}; each line needs its own", param="custom_id",
                               code="duplicate_custom_id")
            seen[line.custom_id] = number
        lines.append(line)
    if not lines:
        raise APIError(400, "the input file holds no request line", param="input_file_id", code="empty_file")
    return lines


def _read_line(raw: bytes, number: int, rules: Rules, batch_id: str) -> LineInput:
    def failed(code: str, message: str, custom_id: str | None = None) -> LineInput:
        return LineInput(number, custom_id, None, error_result(batch_id, number, custom_id, code,
                                                               f"line {number}: {message}"))

    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return failed("invalid_json", "not a JSON object (UTF-8 text, one object per line)")
    if not isinstance(value, dict):
        return failed("invalid_json", "not a JSON object (one object per line)")
    _check_request(value, number, rules)
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return failed("invalid_custom_id", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    body = value.get("body")
    if not isinstance(body, dict):
        return failed("invalid_body", "body must be a JSON object (the request)", custom_id)
    problem = body_problem(body, rules)
    if problem is not None:
        return failed(problem[0], problem[1], custom_id)
    return LineInput(number, custom_id, json.dumps(body, separators=(",", ":"), ensure_ascii=False))


def _check_request(value: dict[str, Any], number: int, rules: Rules) -> None:
    """What makes the whole batch wrong: the line asks for something this batch (or appliance) does not do."""
    method = value.get("method", "POST")
    if method != "POST":
        raise APIError(400, f"line {number}: method must be POST, not {method!r}", param="method",
                       code="invalid_method")
    url = value.get("url")
    if url != rules.endpoint:
        raise APIError(400, f"line {number}: url {url!r} is not the batch's endpoint {rules.endpoint!r}",
                       param="url", code="invalid_url")
    body = value.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model != rules.served_model:
        raise APIError(400, f"line {number}: model {model!r} does not exist; this appliance serves "
                            f"{rules.served_model!r}", param="model", code="model_not_found")


def body_problem(body: dict[str, Any], rules: Rules) -> tuple[str, str] | None:
    """Why the route would refuse this body (code, message), or None: the checks of /v1/completions and
    /v1/chat/completions, and no streaming (a batch line's answer is one JSON body)."""
    if body.get("stream") is True:
        return "stream_not_supported", "stream is not supported in a batch (each answer is one JSON body)"
    try:
        request = parse_body(rules.endpoint, body)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors:
            return "invalid_request", "invalid request"
        param = ".".join(str(part) for part in errors[0]["loc"]) or "body"
        return "invalid_request", f"{param}: {errors[0]['msg']}"
    asked = request.max_tokens
    if isinstance(request, ChatCompletionRequest):
        asked = request.max_completion_tokens or request.max_tokens
    if asked is not None and rules.max_model_len is not None and asked > rules.max_model_len:
        return "max_tokens_too_large", f"max_tokens {asked} exceeds the model's max_model_len {rules.max_model_len}"
    return None


def parse_body(endpoint: str, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    schema: type[BaseModel] = ChatCompletionRequest if ENDPOINTS[endpoint] == "chat" else CompletionRequest
    parsed = schema.model_validate(body)
    assert isinstance(parsed, CompletionRequest | ChatCompletionRequest)
    return parsed


def routing_prompt(endpoint: str, body: str) -> str:
    """The prompt as the router sees it (prefix affinity), rendered as the route renders it."""
    request = parse_body(endpoint, json.loads(body))
    if isinstance(request, ChatCompletionRequest):
        return render_chat(request.messages)
    return render_completion(request.prompt)


# -- results ------------------------------------------------------------------------------------------------------


def answer_result(line: PendingLine, status: int, body: bytes) -> LineResult:
    """A line answered by the gateway: 2xx to the output file, anything else to the error file."""
    request_id = line_request_id(line.batch_id, line.index)
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = {"error": {"message": body.decode("utf-8", "replace")[:2000], "type": "upstream_error"}}
    record = {"id": request_id, "custom_id": line.custom_id,
              "response": {"status_code": status, "request_id": request_id, "body": parsed}, "error": None}
    ok = 200 <= status < 300
    return LineResult(OUTPUT if ok else ERROR, _dumps(record), usage_of(parsed) if ok else Usage())


def error_result(batch_id: str, index: int, custom_id: str | None, code: str, message: str) -> LineResult:
    """A line that got no answer: malformed, expired, cancelled."""
    request_id = line_request_id(batch_id, index)
    record = {"id": request_id, "custom_id": custom_id, "response": None,
              "error": {"code": code, "message": message}}
    return LineResult(ERROR, _dumps(record))


def usage_of(body: Any) -> Usage:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return Usage()
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)
