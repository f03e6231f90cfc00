"""OpenAI-compatible routes. The gateway checks what it must, then forwards the client's bytes to a replica."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from appliance.context import ClientContext, ClientCtx
from appliance.gateway.routes.direct import PARSED_BODY, DirectRoute
from appliance.gateway.routing.request import render_chat, render_completion
from appliance.gateway.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from appliance.http.errors import APIError
from appliance.http.guards import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["openai"])


@router.get("/models", response_model=ModelList)
async def list_models(ctx: ClientCtx) -> ModelList:
    settings = ctx.live.settings
    card = ModelCard(id=settings.served_model_name, created=int(ctx.started_at),
                     max_model_len=settings.engine.max_model_len)
    return ModelList(data=[card])


async def completions(body: CompletionRequest, request: Request, ctx: ClientCtx) -> Response:
    _check_common(ctx, body, body.max_tokens)
    return await _forward(ctx, request, "completions", "/v1/completions", body.stream, render_completion(body.prompt))


async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ClientCtx) -> Response:
    _check_common(ctx, body, body.max_completion_tokens or body.max_tokens)
    return await _forward(ctx, request, "chat", "/v1/chat/completions", body.stream, render_chat(body.messages))


# DirectRoutes (appliance/gateway/routes/direct.py): documented from these signatures like any route, handled without
# FastAPI's per-request dependency solving, with the same answers.
router.add_api_route("/completions", completions, methods=["POST"], route_class_override=DirectRoute)
router.add_api_route("/chat/completions", chat_completions, methods=["POST"], route_class_override=DirectRoute)


def _check_common(ctx: ClientContext, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> None:
    settings = ctx.live.settings
    if body.model is not None and body.model != settings.served_model_name:
        raise APIError(404, f"model '{body.model}' does not exist; this appliance serves "
                            f"'{settings.served_model_name}'", param="model", code="model_not_found")
    limit = settings.engine.max_model_len  # never None once Settings validated: it is read from the model then
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise APIError(400, f"max_tokens {max_tokens} exceeds the model's max_model_len {limit}",
                       param="max_tokens", code="max_tokens_too_large")
    if ctx.live.draining:
        raise APIError(503, "the appliance is draining; retry on another instance", code="draining",
                       headers={"Retry-After": "10"})


async def _forward(ctx: ClientContext, request: Request, route: str, path: str, stream: bool, prompt: str) -> Response:
    arrived = request.scope.get("appliance.arrived", time.monotonic())
    body = await request.body()  # cached by Starlette: the exact bytes the client sent
    return await ctx.gateway.upstream.forward(request, route, path, body, stream=stream, arrived=arrived,
                                              prompt=prompt, parsed=request.scope.pop(PARSED_BODY, None))
