"""OpenAI-style errors: every failure the gateway returns is ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


ErrorHook = Callable[[str, MutableMapping[str, Any], int], None]


class APIError(Exception):
    """An error the client should see as it is: status, message, and optionally the offending field."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, on_error: ErrorHook | None = None,
                           translate: Mapping[type[Exception], Callable[[Exception], APIError]] | None = None) -> None:
    """Route every exception path (ours, FastAPI's validation, Starlette's 404/405) to OpenAI's shape;
    ``on_error(path, scope, status)`` sees each one (the request counter). ``translate`` turns other packages'
    domain errors (maintenance's refusals) into APIErrors, so they take the same path."""

    def answer(request: Request, status: int, message: str, **kwargs: Any) -> JSONResponse:
        if on_error is not None:
            on_error(request.url.path, request.scope, status)
        return error_response(status, message, **kwargs)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    for error_type, to_api_error in (translate or {}).items():
        async def _translated(request: Request, exc: Exception,
                              to_api_error: Callable[[Exception], APIError] = to_api_error) -> JSONResponse:
            return await _api_error(request, to_api_error(exc))

        app.add_exception_handler(error_type, _translated)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return answer(request, 400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # `code`: the intake's refusals (appliance/gateway/intake/limits.py) are HTTPExceptions that carry one
        return answer(request, exc.status_code, str(exc.detail), code=getattr(exc, "code", None),
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, 500, f"internal error: {type(exc).__name__}")
