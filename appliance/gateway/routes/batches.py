"""OpenAI's Files and Batches APIs (``/v1/files``, ``/v1/batches``), and the operator's view of every tenant's
batches (``/admin/batches``: ``appliance batches``).

The routes check the request's shape (FastAPI: a bad value is a 400 in OpenAI's error shape) and move values; the
work is the Batch API's (``appliance.batch``), reached through the context's ``BatchAPI`` Protocol so that the
gateway imports nothing above it. A tenant is the one its API key names (``request.state.tenant``): it sees only its
own files and batches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from appliance.context import AppContext, Context
from appliance.context_parts import BatchAPI
from appliance.http.errors import APIError
from appliance.http.guards import require_admin, require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["batch"])
admin_router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])

ID = r"^[A-Za-z0-9_-]{1,64}$"
STATUS = r"^(validating|in_progress|finalizing|completed|failed|cancelling|cancelled|expired)$"
MAX_METADATA = 16


class BatchCreate(BaseModel):
    """POST /v1/batches; other fields OpenAI takes (output_expires_after) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: StrictStr = Field(..., pattern=ID, description="A file uploaded with purpose \"batch\".")
    endpoint: StrictStr = Field(..., description="/v1/completions or /v1/chat/completions.")
    completion_window: StrictStr = Field(..., description="\"24h\" (\"<N>h\", at most "
                                         "batch.max_completion_window_hours).")
    metadata: dict[StrictStr, StrictStr] | None = Field(None, description="Up to 16 pairs, kept and shown back.")

    @field_validator("metadata")
    @classmethod
    def _openai_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in value.items())):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys up to 64 characters, values up to 512")
        return value


def _api(ctx: AppContext) -> BatchAPI:
    if ctx.batch is None:
        raise APIError(404, "the Batch API is off on this appliance (batch.enabled)", code="batch_api_off")
    return ctx.batch


def _tenant(request: Request) -> str:
    name: str = request.state.tenant.name  # set by require_api_key
    return name


# -- files ----------------------------------------------------------------------------------------------------------


@router.post("/files")
async def upload_file(request: Request, ctx: Context, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form(max_length=64)]) -> dict[str, Any]:
    """Upload a JSONL file of requests (purpose \"batch\"), up to batch.max_file_bytes."""
    api = _api(ctx)
    return await api.upload(_tenant(request), purpose, file.filename or "", await file.read())


@router.get("/files")
async def list_files(
    request: Request, ctx: Context,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: Annotated[str | None, Query(pattern=ID)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> dict[str, Any]:
    return await _api(ctx).files(_tenant(request), purpose=purpose, after=after, limit=min(limit, 100), order=order)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).file(_tenant(request), file_id)


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, request: Request, ctx: Context) -> Response:
    data = await _api(ctx).content(_tenant(request), file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).delete_file(_tenant(request), file_id)


# -- batches --------------------------------------------------------------------------------------------------------


@router.post("/batches")
async def create_batch(body: BatchCreate, request: Request, ctx: Context) -> dict[str, Any]:
    """Run every line of the input file on the capacity interactive traffic leaves; poll with GET."""
    return await _api(ctx).create(_tenant(request), input_file_id=body.input_file_id, endpoint=body.endpoint,
                                  completion_window=body.completion_window, metadata=body.metadata)


@router.get("/batches")
async def list_batches(request: Request, ctx: Context,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: Annotated[str | None, Query(pattern=ID)] = None) -> dict[str, Any]:
    return await _api(ctx).batches(_tenant(request), after=after, limit=limit)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).batch(_tenant(request), batch_id)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).cancel(_tenant(request), batch_id)


# -- the operator's view --------------------------------------------------------------------------------------------


@admin_router.get("/batches")
async def admin_batches(ctx: Context,
                        tenant: Annotated[str | None, Query(max_length=200)] = None,
                        status: Annotated[str | None, Query(pattern=STATUS)] = None,
                        limit: Annotated[int, Query(ge=1, le=100)] = 20,
                        after: Annotated[str | None, Query(pattern=ID)] = None) -> dict[str, Any]:
    """Every tenant's batches, newest first (``appliance batches``)."""
    return await _api(ctx).batches(tenant, after=after, limit=limit, status=status, operator=True)


@admin_router.get("/batches/{batch_id}")
async def admin_batch(batch_id: str, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).batch(None, batch_id, operator=True)


@admin_router.post("/batches/{batch_id}/cancel")
async def admin_cancel(batch_id: str, ctx: Context) -> dict[str, Any]:
    return await _api(ctx).cancel(None, batch_id, operator=True)
