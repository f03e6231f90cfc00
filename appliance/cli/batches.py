"""``appliance batches``: every tenant's batches from a shell (the admin API's /admin/batches): list them, show
one, cancel one. Standard library only, like the other admin commands."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any
from urllib.parse import quote, urlencode

from appliance.admin_client import age
from appliance.cli.argtypes import http_url, positive_int
from appliance.cli.common import add_command, admin_call

MAX_LIMIT = 100  # what GET /admin/batches serves at once
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")


def register(sub: Any) -> None:
    from appliance.admin_client import DEFAULT_URL, TOKEN_ENV

    url_help = (f"gateway URL (http://HOST:PORT or HOST:PORT); the admin token comes from ${TOKEN_ENV} or the "
                "admin-token file `appliance up` writes")
    common = argparse.ArgumentParser(add_help=False)  # before or after the action: a default here would win
    common.add_argument("--url", type=http_url, default=argparse.SUPPRESS, help=url_help)
    p = add_command(sub, "batches", "batches of every tenant (OpenAI Batch API): list, show ID, cancel ID (admin "
                    "API)", cmd_batches, description="Lists the batches tenants sent to /v1/batches, newest first "
                    "(`appliance batches` is `appliance batches list`), shows one in full (its status, line counts, "
                    "times, result files), or cancels one (its lines in flight are given back; what was answered "
                    "goes to its output file). Batches run on the capacity interactive traffic leaves "
                    "(docs/batch.md).")
    p.add_argument("--url", type=http_url, default=DEFAULT_URL, help=url_help)
    actions = p.add_subparsers(dest="action", metavar="ACTION", help="list (the default), show ID or cancel ID")
    listing = actions.add_parser("list", parents=[common], help="newest first")
    listing.add_argument("--tenant", help="only this tenant's batches")
    listing.add_argument("--status", choices=STATUSES, help="only batches in this status")
    listing.add_argument("--limit", type=_limit, default=20, help=f"at most this many (1-{MAX_LIMIT})")
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    show = actions.add_parser("show", parents=[common], help="one batch in full")
    show.add_argument("batch_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="print the raw JSON")
    cancel = actions.add_parser("cancel", parents=[common], help="cancel a validating or in-progress batch")
    cancel.add_argument("batch_id", metavar="ID")
    p.set_defaults(action=None, tenant=None, status=None, limit=20, json=False)  # the bare command: list


def _limit(text: str) -> int:
    value = positive_int(text)
    if value > MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is more than {MAX_LIMIT}")
    return value


def cmd_batches(args: argparse.Namespace) -> int:
    if args.action in (None, "list"):
        body = admin_call(args.url, "GET", batches_path(args.limit, args.tenant, args.status))
        print(json.dumps(body, indent=2) if args.json else format_batches(body))
    elif args.action == "show":
        batch = admin_call(args.url, "GET", "/admin/batches/" + quote(args.batch_id, safe=""))
        print(json.dumps(batch, indent=2) if args.json else format_batch(batch))
    else:
        batch = admin_call(args.url, "POST", "/admin/batches/" + quote(args.batch_id, safe="") + "/cancel")
        print(f"{batch['id']}: {batch['status']} ({_counts(batch)}); follow with `appliance batches show "
              f"{batch['id']}`")
    return 0


def batches_path(limit: int = 20, tenant: str | None = None, status: str | None = None) -> str:
    query = {"limit": limit, "tenant": tenant, "status": status}
    return "/admin/batches?" + urlencode({k: v for k, v in query.items() if v is not None})


def format_batches(body: dict[str, Any], now: float | None = None) -> str:
    batches = body.get("data") or []
    if not batches:
        return "no batch matches"
    now = time.time() if now is None else now
    width = max(len("id"), *(len(b["id"]) for b in batches))
    lines = [f"{'id':<{width}} {'tenant':<16} {'status':<11} {'endpoint':<20} {'done':>7} {'failed':>7} "
             f"{'total':>7} {'age':>5}"]
    for b in batches:
        counts = b.get("request_counts") or {}
        lines.append(f"{b['id']:<{width}} {b.get('tenant') or '-':<16} {b['status']:<11} {b['endpoint']:<20} "
                     f"{counts.get('completed', 0):>7} {counts.get('failed', 0):>7} {counts.get('total', 0):>7} "
                     f"{age(now - b['created_at']):>5}")
    if body.get("has_more"):
        lines.append("... more (--limit, --tenant, --status)")
    return "\n".join(lines)


def format_batch(batch: dict[str, Any]) -> str:
    lines = [f"batch {batch['id']}  tenant {batch.get('tenant') or '-'}  {batch['endpoint']}  "
             f"window {batch['completion_window']}",
             f"status {batch['status']}  {_counts(batch)}"]
    for status in ("created", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                   "cancelled", "expires"):
        when = batch.get(f"{status}_at")
        if when:
            lines.append(f"  {status + ' at':<16} {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(when))}")
    lines.append(f"input file {batch['input_file_id']}  output file {batch.get('output_file_id') or '-'}  "
                 f"error file {batch.get('error_file_id') or '-'}")
    usage = batch.get("usage") or {}
    if usage.get("total_tokens"):
        lines.append(f"tokens: {usage['input_tokens']} prompt, {usage['output_tokens']} completion")
    for error in ((batch.get("errors") or {}).get("data") or []):
        lines.append(f"error {error.get('code')}: {error.get('message')}")
    return "\n".join(lines)


def _counts(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    return (f"{counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed of "
            f"{counts.get('total', 0)} lines")


