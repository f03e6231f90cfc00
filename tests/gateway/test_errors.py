"""Every bad input gets OpenAI's error JSON with the right 4xx, and never reaches an engine."""

import pytest

from appliance.context import context_of


def assert_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b'{"model": "demo"}'),
        ("/v1/completions", b'{"prompt": 5}'),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 10000000}'),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e9}'),
    ],
)
def test_bad_input_is_a_400(client, stubs, path, body):
    assert_error(client.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert not any(stub.received for stub in stubs)


def test_unknown_model_is_a_404(client):
    error = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert error["param"] == "model"


def test_unknown_route_is_openai_shaped(client):
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_api_key_required_when_configured(make_client):
    client = make_client(api_keys=["k1", "k2"])
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 401)
    assert_error(client.post("/v1/completions", json={"prompt": "hi"},
                             headers={"authorization": "Bearer wrong"}), 401)
    assert client.post("/v1/completions", json={"prompt": "hi"},
                       headers={"authorization": "Bearer k2"}).status_code == 200
    assert client.get("/health/live").status_code == 200  # health stays open for probes


def test_body_over_the_limit_is_a_413(make_client, stubs):
    client = make_client(max_request_bytes=2048)
    body = b'{"prompt": "' + b"x" * 4096 + b'"}'
    assert_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)
    assert not any(stub.received for stub in stubs)


def test_draining_gateway_answers_503(client):
    context_of(client.app).live.draining = True
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert_error(response, 503)
    assert response.headers["retry-after"]
    assert client.get("/health/ready").status_code == 503


def test_chunked_body_over_the_limit_is_a_413(make_client, stubs):
    """Without Content-Length the size is counted as the body arrives; the answer is still 413, not FastAPI's
    400 'error parsing the body'."""
    client = make_client(max_request_bytes=2048)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"x" * 1024
        yield b'"}'

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(client.post(path, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert not any(stub.received for stub in stubs)


def test_engine_addresses_and_api_docs_are_closed_when_api_keys_are_set(make_client):
    client = make_client(api_keys=["k1"], admin_token="admin")
    assert_error(client.get("/sd/targets"), 401)
    assert_error(client.get("/sd/targets", headers={"authorization": "Bearer wrong"}), 401)
    for token in ("admin", "k1"):  # Prometheus sends the admin token (http_sd_configs.authorization)
        assert client.get("/sd/targets", headers={"authorization": f"Bearer {token}"}).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404


def test_engine_addresses_and_api_docs_stay_open_without_api_keys(client):
    assert client.get("/sd/targets").status_code == 200
    assert client.get("/openapi.json").status_code == 200
