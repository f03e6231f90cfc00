"""A route FastAPI documents like any other, whose requests the gateway handles without FastAPI's per-request
machinery: the OpenAI POST routes, where that machinery was 8-10% of the gateway's CPU with short answers (its
dependency solving builds query, header and cookie parameters for every dependency of every request, the body goes
through a generic field adapter, and the hooks parsed the body a second time).

``DirectRoute`` keeps FastAPI's answers exactly, in FastAPI's order: the body is read (an intake refusal stays the
intake's 413/408/503; any other failure to read it is FastAPI's 400 "error parsing the body"), parsed as JSON when
its content type says so (a decode error is FastAPI's ``RequestValidationError`` at the error's position; no
content type: the raw bytes, which fail validation, as FastAPI's strict content type has it), then the route's
dependencies run (the API key's 401 comes before any body error), then the body is validated with its model, and
its errors go to the app's handler as FastAPI's would. /openapi.json is built from the endpoint's signature, as
for any route.

An endpoint of this class may declare only what the handler gives: one body model, the ``Request``, and the
``ClientCtx``; its router's dependency may be ``require_api_key`` only. Anything else is refused when the route
is built, never silently skipped per request. ``app.dependency_overrides`` do not reach these routes.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, get_args

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from appliance.context import ClientCtx, client_context
from appliance.http.guards import require_api_key

PARSED_BODY = "appliance.parsed_body"
"""The scope key under which the handler leaves the body it parsed, when a JSON object, for the endpoint to hand
to the transport (``request.scope.pop``): one parse per request, and one owner of the dict, which hooks mutate."""

_CLIENT_CONTEXT = get_args(ClientCtx)[1].dependency
_DEPENDENCIES = {require_api_key, _CLIENT_CONTEXT}
_BODY_UNREADABLE = "There was an error parsing the body"  # FastAPI's words, kept for clients that match them

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
M = TypeVar("M", bound=BaseModel)


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose handler reads, parses and validates the body itself and calls the endpoint directly."""

    def get_route_handler(self) -> Handler:
        model, names = self._parameters()
        endpoint = self.endpoint
        body_name, request_name, ctx_name = names

        async def handle(request: Request) -> Response:
            value = await json_body(request)
            await require_api_key(request)
            ctx = client_context(request)
            body = validated(model, value)
            if isinstance(value, dict):
                request.scope[PARSED_BODY] = value
            response: Response = await endpoint(**{body_name: body, request_name: request, ctx_name: ctx})
            return response

        return handle

    def _parameters(self) -> tuple[type[BaseModel], tuple[str, str, str]]:
        """The body's model, and the names of the endpoint's body, request and context parameters; raises if the
        endpoint declares anything the handler does not give."""
        dependant = self.dependant
        unhandled = [*dependant.path_params, *dependant.query_params, *dependant.header_params,
                     *dependant.cookie_params, *filter(None, (
                         dependant.background_tasks_param_name, dependant.response_param_name,
                         dependant.security_scopes_param_name, dependant.http_connection_param_name))]
        calls = {sub.call for sub in dependant.dependencies}
        contexts = [sub.name for sub in dependant.dependencies if sub.call is _CLIENT_CONTEXT and sub.name]
        if (unhandled or not calls <= _DEPENDENCIES or len(dependant.body_params) != 1 or len(contexts) != 1
                or dependant.request_param_name is None or self._embed_body_fields):
            raise TypeError(f"{self.path}: a DirectRoute endpoint takes one body model, the Request and the "
                            "ClientCtx, under require_api_key only")
        field = dependant.body_params[0]
        model = field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{self.path}: a DirectRoute's body is a pydantic model")
        return model, (field.name, dependant.request_param_name, contexts[0])


async def json_body(request: Request) -> Any:
    """The body as FastAPI reads a JSON body parameter: None when empty, parsed when its content type is JSON, the
    raw bytes otherwise."""
    try:
        raw = await request.body()
    except HTTPException:  # the intake's refusals: answered by the app's handler with their status and code
        raise
    except Exception as exc:  # the client left mid-body
        raise HTTPException(400, _BODY_UNREADABLE) from exc
    if not raw:
        return None
    if not is_json(request.headers.get("content-type")):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except Exception as exc:  # not UTF-8/16/32, or nested deeper than the parser recurses
        raise HTTPException(400, _BODY_UNREADABLE) from exc


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (application/json or application/*+json)."""
    if content_type == "application/json":  # what clients send: no header parsing
        return True
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def validated(model: type[M], value: Any) -> M:
    """``value`` as ``model``, or FastAPI's ``RequestValidationError``: the same errors, located under "body"."""
    if value is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}],
                                     body=None)
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None
