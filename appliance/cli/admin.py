"""``appliance status``, ``drain``, ``restart``, ``reload`` and ``requests``: the admin API from a shell, for
runbooks."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from appliance.cli.argtypes import http_url, non_negative_float, positive_int
from appliance.cli.common import CLIError, add_command, admin_call
from appliance.exit_codes import EXIT_USAGE


def register(sub: Any) -> None:
    p = add_command(sub, "status", "replicas, state, load, KV usage, restarts, tenants (admin API)", cmd_status)
    _admin_flags(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON")

    p = add_command(sub, "drain", "take a replica out of routing; in-flight requests finish", cmd_drain)
    _admin_flags(p)
    p.add_argument("replica", help="e.g. replica-0")
    p.add_argument("--undo", action="store_true", help="return a drained replica to routing")

    p = add_command(sub, "restart", "drain a replica, let it finish, restart, warm and return it; or --rolling",
                    cmd_restart)
    _admin_flags(p)
    p.add_argument("replica", nargs="?", help="e.g. replica-0")
    p.add_argument("--rolling", action="store_true", help="restart every replica, one at a time (a rolling restart)")

    p = add_command(sub, "reload", "re-read the configuration given at start: tenants and keys apply at once, engine "
                    "settings by a rolling restart",
                    cmd_reload, description="Re-reads the configuration file and environment the appliance was "
                    "started with, validates them, and restarts the replicas one at a time onto the new engine.* "
                    "settings; tenants, API keys and the admin, alerts and metrics tokens apply at once, without a "
                    "restart (quota levels kept; a replaced key or token stays valid for "
                    "gateway.secret_overlap_seconds). Changes that cannot roll (ports, host, replica count, model, "
                    "other gateway settings) are refused with the keys listed; nothing changes then.")
    _admin_flags(p)

    p = add_command(sub, "requests", "the last requests: where each went, why, and where its time went "
                    "(admin API)", cmd_requests, description="Lists the last requests the gateway kept a record "
                    "of (gateway.request_records), newest first: tenant, route, the replica that answered and "
                    "what decided the pick, queue wait, TTFT, end-to-end time, status, retries and migrations. "
                    "--id shows one request in full: each attempt with its routing decision (every replica "
                    "considered, the filter that removed each one left out, every scorer's value) and why it "
                    "ended. Only requests that have ended are listed; the records live in the gateway's memory.")
    _admin_flags(p)
    p.add_argument("--limit", type=_limit, default=50, help=f"at most this many requests (1-{MAX_LIMIT})")
    p.add_argument("--tenant", help="only this tenant's requests")
    p.add_argument("--replica", help="only requests that went to (or were moved from) this replica")
    p.add_argument("--slow", type=non_negative_float, metavar="SECONDS",
                   help="only requests that took at least this long end to end")
    p.add_argument("--status", type=_status,
                   help="only this HTTP status (503), class (5xx) or outcome (aborted, failure)")
    p.add_argument("--id", help="one request in full, by its id (the client's x-request-id when it sent one)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")


MAX_LIMIT = 1000  # what GET /admin/requests serves at once
# The statuses GET /admin/requests accepts (appliance/gateway/routes/requests.py; a test keeps the two equal),
# checked here too so that a typo is a usage error (exit 2), not a refusal from the appliance.
STATUS_PATTERN = r"^([1-5][0-9][0-9]|[1-5]xx|[a-z_]{1,32})$"


def _limit(text: str) -> int:
    value = positive_int(text)
    if value > MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is more than {MAX_LIMIT}")
    return value


def _status(text: str) -> str:
    if not re.fullmatch(STATUS_PATTERN, text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an HTTP status (503), a class (5xx) or an outcome")
    return text


def _admin_flags(p: argparse.ArgumentParser) -> None:
    from appliance.admin_client import DEFAULT_URL, TOKEN_ENV

    p.add_argument("--url", type=http_url, default=DEFAULT_URL,
                   help=f"gateway URL (http://HOST:PORT or HOST:PORT); the admin token comes from ${TOKEN_ENV} or "
                        "the admin-token file `appliance up` writes")


def cmd_status(args: argparse.Namespace) -> int:
    from appliance.admin_client import format_status

    status = admin_call(args.url, "GET", "/admin/status")
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    action = "undrain" if args.undo else "drain"
    result = admin_call(args.url, "POST", f"/admin/replicas/{args.replica}/{action}")
    print(f"{result['name']}: {result['state']}, {result['outstanding']} request(s) in flight")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    if bool(args.rolling) == bool(args.replica):
        raise CLIError("give a REPLICA or --rolling (not both)", EXIT_USAGE)
    path = "/admin/rolling-restart" if args.rolling else f"/admin/replicas/{args.replica}/restart"
    result = admin_call(args.url, "POST", path)
    what = "rolling restart of " + ", ".join(result.get("replicas", [])) if args.rolling else args.replica
    print(f"{what}: accepted (each replica drains first); follow with `appliance status`")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    result = admin_call(args.url, "POST", "/admin/reload")
    if not result.get("changed"):
        print("reload: the configuration has no changes; nothing to do")
    elif not result.get("rolling_restart"):
        print(f"reload: {', '.join(result['changed'])} changed; applied at once (no restart)")
    else:
        print(f"reload: {', '.join(result['changed'])} changed; rolling restart accepted (one replica at a time); "
              "follow with `appliance status`")
    return 0


def cmd_requests(args: argparse.Namespace) -> int:
    """The table of the last requests, or one request in full (--id); exit 1 when the gateway holds no such id."""
    from appliance.admin_client import format_request, format_requests, request_path, requests_path

    if args.id is not None:
        if any(value is not None for value in (args.tenant, args.replica, args.slow, args.status)):
            raise CLIError("--id shows one request: give it without --tenant, --replica, --slow or --status",
                           EXIT_USAGE)
        record = admin_call(args.url, "GET", request_path(args.id))
        print(json.dumps(record, indent=2) if args.json else format_request(record))
        return 0
    body = admin_call(args.url, "GET", requests_path(args.limit, args.tenant, args.replica, args.slow, args.status))
    print(json.dumps(body, indent=2) if args.json else format_requests(body))
    return 0
