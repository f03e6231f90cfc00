"""DirectRoute answers as FastAPI's own handling of the same endpoint would: the OpenAI POST routes served by both,
side by side, for bad JSON, wrong types, non-object bodies, content types, missing and wrong keys."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.exceptions import HTTPException

from appliance.app import create_app
from appliance.context import ClientCtx, context_of
from appliance.gateway.routes import openai
from appliance.gateway.routes.direct import DirectRoute, json_body
from appliance.gateway.schemas import CompletionRequest, ModelList
from appliance.http.errors import install_error_handlers
from appliance.http.guards import require_api_key
from appliance.settings import Settings
from tests.doubles import FakeReplica

KEY = {"authorization": "Bearer k1"}
PATHS = ("/v1/completions", "/v1/chat/completions")


async def _echo(request: Request, route: str, path: str, body: bytes, **kwargs: Any) -> Response:
    """The transport's place: what the route forwards, so that both apps' successes can be compared."""
    echoed = {"route": route, "path": path, "body": body.decode("latin-1"), "stream": kwargs["stream"],
              "prompt": kwargs["prompt"], "tenant": request.state.tenant.name}
    return Response(json.dumps(echoed), media_type="application/json")


def _app(router: APIRouter, context: Any) -> FastAPI:
    app = FastAPI()
    app.state.context = context
    install_error_handlers(app)
    app.include_router(router)
    return app


@pytest.fixture(scope="module")
def clients() -> tuple[TestClient, TestClient]:
    """The gateway's /v1 router (DirectRoutes), and the same endpoints as plain FastAPI routes, on one context;
    neither behind the intake, so the routes' own order (401 before body errors) shows."""
    source = create_app(Settings(served_model_name="demo", api_keys=["k1"]),
                        replicas=lambda: [FakeReplica("replica-0", "http://127.0.0.1:9")])
    context = context_of(source)
    context.gateway.upstream.forward = _echo  # type: ignore[method-assign]
    reference = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["openai"])
    reference.add_api_route("/models", openai.list_models, methods=["GET"], response_model=ModelList)
    reference.add_api_route("/completions", openai.completions, methods=["POST"])
    reference.add_api_route("/chat/completions", openai.chat_completions, methods=["POST"])
    return (TestClient(_app(openai.router, context), raise_server_exceptions=False),
            TestClient(_app(reference, context), raise_server_exceptions=False))


def _both(clients: tuple[TestClient, TestClient], path: str, body: bytes,
          headers: dict[str, str]) -> tuple[Any, Any]:
    answers = [client.post(path, content=body, headers=headers) for client in clients]
    return tuple((a.status_code, a.json(), {k: v for k, v in a.headers.items() if k != "content-length"})
                 for a in answers)


CORPUS = [
    b"", b"null", b"{not json", b'{"prompt": "hi",}', b"[1, 2]", b"5", b'"text"', b"{}", b'{"model": "demo"}',
    b'{"prompt": 5}', b'{"prompt": []}', b'{"prompt": "hi", "max_tokens": "ten"}', b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": "hi", "max_tokens": 10000000}', b'{"prompt": "hi", "stream": "yes"}', b'{"prompt": "hi", "n": 17}',
    b'{"prompt": "hi", "model": "gpt-9"}', b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "cache_salt": "a/b"}',
    b'{"prompt": [1, "a"]}', b'{"prompt": "hi", "stream": true, "x": {"y": [1]}}', b"\xff\xfe{", b"[" * 100_000,
    b'{"messages": []}', b'{"messages": "hi"}', b'{"messages": [{"content": "no role"}]}', b'{"messages": [1]}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e9}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stream": true}',
]
CONTENT_TYPES = [None, "application/json", "text/plain", "application/json; charset=utf-8", "Application/JSON",
                 "application/vnd.api+json", "application/x-www-form-urlencoded"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("authorization", [None, "Bearer k1", "Bearer wrong"])
def test_every_answer_is_fastapis(clients, path, content_type, authorization):
    headers = {k: v for k, v in (("content-type", content_type), ("authorization", authorization)) if v}
    for body in CORPUS:
        direct, reference = _both(clients, path, body, headers)
        assert direct == reference, (body[:60], headers)


SCALAR = st.none() | st.booleans() | st.integers(-3, 10**8) | st.floats(allow_nan=False) | st.text(max_size=8)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3), max_leaves=8)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "n",
                          "temperature", "top_p", "cache_salt", "role", "content", "other"])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "", 5]),
                                 "content": st.none() | st.text(max_size=4) | JSON})
BODY = (JSON | st.dictionaries(FIELDS, JSON | st.lists(MESSAGE, max_size=2) | st.sampled_from(["demo", "hi", 1, -1]),
                               max_size=5))


@settings(max_examples=150, deadline=None)
@given(body=BODY, path=st.sampled_from(PATHS), authorization=st.sampled_from([None, "Bearer k1", "Bearer no"]))
def test_any_json_body_is_answered_as_fastapi_answers_it(clients, body, path, authorization):
    headers = {"content-type": "application/json", **({"authorization": authorization} if authorization else {})}
    direct, reference = _both(clients, path, json.dumps(body).encode(), headers)
    assert direct == reference


def test_bad_bodies_get_openai_errors(clients):
    """What the comparison above holds the routes to, spelt out."""
    direct, _ = clients
    json_headers = {**KEY, "content-type": "application/json"}
    answer = direct.post("/v1/completions", content=b'{"prompt": "hi",}', headers=json_headers)
    assert answer.status_code == 400
    assert answer.json()["error"] == {"message": "16: JSON decode error", "type": "invalid_request_error",
                                      "param": "16", "code": None}
    for body, message in (
        (b"[1, 2]", "request: Input should be a valid dictionary or object to extract fields from"),
        (b"null", "request: Field required"),
        (b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens: Input should be a valid integer"),
        (b"\xff\xfe{", "There was an error parsing the body"),
    ):
        answer = direct.post("/v1/completions", content=body, headers=json_headers)
        assert (answer.status_code, answer.json()["error"]["message"]) == (400, message), body
    assert direct.post("/v1/completions", content=b'{"prompt": "hi"}', headers=KEY).status_code == 400  # no type
    answer = direct.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, None)  # a decode error comes first
    answer = direct.post("/v1/completions", content=b'{"prompt": 5}', headers={"content-type": "application/json"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "invalid_api_key")  # then the key


def test_the_openapi_document_is_fastapis(clients):
    direct, reference = clients
    assert direct.get("/openapi.json").json() == reference.get("/openapi.json").json()


def test_a_client_gone_mid_body_is_fastapis_400():
    async def scenario() -> None:
        messages = iter([{"type": "http.request", "body": b'{"pro', "more_body": True}, {"type": "http.disconnect"}])

        async def receive() -> dict[str, Any]:
            return next(messages)

        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)
        with pytest.raises(HTTPException) as caught:
            await json_body(request)
        assert (caught.value.status_code, caught.value.detail) == (400, "There was an error parsing the body")

    asyncio.run(scenario())


def test_an_endpoint_that_declares_more_than_the_handler_gives_is_refused():
    async def paged(body: CompletionRequest, request: Request, ctx: ClientCtx, page: int = 0) -> Response:
        raise AssertionError("never called")

    async def untyped(body: dict[str, Any], request: Request, ctx: ClientCtx) -> Response:
        raise AssertionError("never called")

    async def with_response(body: CompletionRequest, request: Request, ctx: ClientCtx, response: Response) -> Response:
        raise AssertionError("never called")

    for endpoint in (paged, untyped, with_response):
        with pytest.raises(TypeError, match="DirectRoute"):
            DirectRoute("/v1/completions", endpoint, methods=["POST"])
    assert isinstance(DirectRoute("/v1/completions", openai.completions, methods=["POST"]), APIRoute)
