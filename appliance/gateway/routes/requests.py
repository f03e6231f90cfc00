"""``GET /admin/requests`` and ``GET /admin/requests/{id}``: the last requests' records
(appliance/gateway/observation/records.py), for "why did this request go there, and why was it slow?".

Admin token required, like every /admin route: a record names tenants and request ids. Query values are
validated by FastAPI, so a bad one is a 400 in OpenAI's error shape (appliance/http/errors.py), never a 500.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from appliance.context import Context
from appliance.http.errors import APIError
from appliance.http.guards import require_admin

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])

MAX_LIMIT = 1000
# An HTTP status (503), a class of them (5xx), or an outcome (success, failure, client_error, timed_out, aborted)
STATUS_PATTERN = r"^([1-5][0-9][0-9]|[1-5]xx|[a-z_]{1,32})$"


@router.get("/requests")
async def recent_requests(
    ctx: Context,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="How many records at most, newest first.")] = 50,
    tenant: Annotated[str | None, Query(max_length=200, description="Only this tenant's requests.")] = None,
    replica: Annotated[str | None, Query(max_length=200, description="Only requests that went to (or were "
                                         "moved from) this replica.")] = None,
    min_seconds: Annotated[float | None, Query(ge=0, allow_inf_nan=False, description="Only requests that took "
                                               "at least this long, end to end.")] = None,
    status: Annotated[str | None, Query(pattern=STATUS_PATTERN, description="An HTTP status (503), a class (5xx), "
                                        "or an outcome (aborted).")] = None,
) -> dict[str, Any]:
    """The last requests' records, newest first; ``capacity`` 0 means the gateway keeps none
    (gateway.request_records)."""
    records = ctx.gateway.records
    return {"capacity": records.capacity, "held": len(records),
            "requests": records.recent(limit, tenant=tenant, replica=replica, min_seconds=min_seconds,
                                       status=status)}


@router.get("/requests/{request_id:path}")
async def one_request(request_id: str, ctx: Context) -> dict[str, Any]:
    """One request's record by its id (the client's x-request-id when it sent one); 404 when not held (never
    kept, or pushed out of the ring by newer requests)."""
    record = ctx.gateway.records.get(request_id)
    if record is None:
        raise APIError(404, f"no record of request {request_id!r}: unknown, or older than the last "
                       f"{ctx.gateway.records.capacity} requests the gateway keeps (gateway.request_records)",
                       param="id", code="request_not_found")
    return record
