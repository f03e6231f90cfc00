"""The OpenAI POST routes against fake engines (tests/fake_engine.py): the client's body is parsed once, by the
route, and the dict it parsed is what the hooks read and change."""

import json
import sys

import pytest

GATEWAY_SIDE = ("appliance.", "starlette.", "fastapi.")  # where the gateway's process parses a request body


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "demo", "prompt": "hi", "stream": True, "vendor_field": {"x": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
])
def test_the_body_is_parsed_once(client, stubs, monkeypatch, path, body):
    raw = json.dumps(body).encode()
    loads = json.loads
    parses: list[bytes] = []

    def counting_loads(value, *args, **kwargs):
        caller = sys._getframe(1).f_globals["__name__"]
        if value == raw and caller.startswith(GATEWAY_SIDE):  # not the fake engine's parse of what it received
            parses.append(value)
        return loads(value, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert len(parses) == 1
    received = [r for stub in stubs for r in stub.received]
    assert len(received) == 1
    if body.get("stream"):  # the metering hook's override (it changes the parsed dict) reached the engine
        assert loads(received[0].raw)["stream_options"]["include_usage"] is True
    else:
        assert received[0].raw == raw
