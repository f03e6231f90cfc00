"""Reading an input file: what is wrong with the batch as a whole is a 400 when it is created; what is wrong with
one line fails that line alone (its error goes to the error file). Results are written as OpenAI writes them."""

from __future__ import annotations

import json

import pytest

from appliance.batch.lines import Rules, answer_result, error_result, read_lines, routing_prompt
from appliance.batch.model import ERROR, OUTPUT, PendingLine, Usage, line_request_id
from appliance.http.errors import APIError
from tests.batch.conftest import chat_line, jsonl

RULES = Rules("/v1/chat/completions", "demo", 1024, max_lines=100)


def read(*lines: dict | str, rules: Rules = RULES):
    return read_lines(jsonl(lines), rules, "batch_x")


def refused(*lines: dict | str, rules: Rules = RULES) -> APIError:
    with pytest.raises(APIError) as caught:
        read(*lines, rules=rules)
    assert caught.value.status == 400
    return caught.value


def test_good_lines_are_kept_in_order_and_blank_lines_skipped():
    parsed = read(chat_line("a"), "", "   ", chat_line("b", temperature=0))
    assert [(line.index, line.custom_id, line.result) for line in parsed] == [(1, "a", None), (4, "b", None)]
    assert json.loads(parsed[1].body)["temperature"] == 0


@pytest.mark.parametrize(("line", "code"), [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, "invalid_custom_id"),
    ({**chat_line("a"), "custom_id": 7}, "invalid_custom_id"),
    ({**chat_line("a"), "body": "hello"}, "invalid_body"),
    (chat_line("a", messages=[]), "invalid_request"),
    (chat_line("a", max_tokens=0), "invalid_request"),
    (chat_line("a", max_tokens=5000), "max_tokens_too_large"),
    (chat_line("a", stream=True), "stream_not_supported"),
])
def test_a_malformed_line_fails_alone(line, code):
    first, second = read(line, chat_line("ok"))
    assert first.body is None and first.result is not None and first.result.kind == ERROR
    error = json.loads(first.result.text)
    assert error["error"]["code"] == code and error["error"]["message"].startswith("line 1: ")
    assert error["response"] is None and error["id"] == line_request_id("batch_x", 1)
    assert second.result is None  # the rest runs


@pytest.mark.parametrize(("line", "code", "param"), [
    ({**chat_line("a"), "url": "/v1/embeddings"}, "invalid_url", "url"),
    ({**chat_line("a"), "url": "/v1/completions"}, "invalid_url", "url"),
    ({**chat_line("a"), "method": "GET"}, "invalid_method", "method"),
    (chat_line("a", model="gpt-4o"), "model_not_found", "model"),
])
def test_what_the_batch_cannot_run_is_refused_whole(line, code, param):
    error = refused(chat_line("ok"), line)
    assert (error.code, error.param) == (code, param)
    assert error.message.startswith("line 2: ")


def test_a_custom_id_used_twice_is_refused():
    error = refused(chat_line("a"), chat_line("b"), chat_line("a"))
    assert error.code == "duplicate_custom_id" and "line 3" in error.message and "line 1" in error.message


def test_too_many_lines_and_no_line_are_refused():
    assert refused(*(chat_line(str(i)) for i in range(3)), rules=Rules(RULES.endpoint, "demo", 1024, 2)).code \
        == "too_many_lines"
    assert refused("", " ").code == "empty_file"


def test_completions_lines_are_checked_against_their_own_schema():
    rules = Rules("/v1/completions", "demo", 1024, 10)
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}
    bad = {**good, "custom_id": "b", "body": {"max_tokens": 2}}
    first, second = read(good, bad, rules=rules)
    assert first.result is None and json.loads(second.result.text)["error"]["code"] == "invalid_request"
    assert routing_prompt("/v1/completions", first.body) == "hi"


def test_an_answer_goes_to_the_output_file_only_when_2xx():
    line = PendingLine("batch_x", 3, "c3", "{}")
    body = {"id": "chatcmpl-1", "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 4}}}
    ok = answer_result(line, 200, json.dumps(body).encode())
    assert ok.kind == OUTPUT and ok.usage == Usage(7, 3, 4)
    assert json.loads(ok.text) == {"id": line_request_id("batch_x", 3), "custom_id": "c3", "error": None,
                                   "response": {"status_code": 200, "request_id": line_request_id("batch_x", 3),
                                                "body": body}}
    refused_ = answer_result(line, 400, b'{"error": {"message": "no"}}')
    assert refused_.kind == ERROR and refused_.usage == Usage()
    assert json.loads(refused_.text)["response"]["status_code"] == 400
    garbled = json.loads(answer_result(line, 502, b"<html>bad gateway</html>").text)
    assert garbled["response"]["body"]["error"]["message"] == "<html>bad gateway</html>"


def test_an_unanswered_line_has_an_error_and_no_response():
    result = json.loads(error_result("batch_x", 1, "c1", "batch_expired", "too late").text)
    assert result == {"id": line_request_id("batch_x", 1), "custom_id": "c1", "response": None,
                      "error": {"code": "batch_expired", "message": "too late"}}
