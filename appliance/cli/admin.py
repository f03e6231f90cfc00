"""``appliance status``, ``drain`` and ``restart``: the admin API from a shell, for runbooks."""

from __future__ import annotations

import argparse
import json
from typing import Any

from appliance.cli.argtypes import http_url
from appliance.cli.common import CLIError, add_command
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
                    "settings; tenants and API keys apply at once, without a restart (quota levels kept). Changes "
                    "that cannot roll (ports, host, replica count, model, gateway settings) are refused with the "
                    "keys listed; nothing changes then.")
    _admin_flags(p)


def _admin_flags(p: argparse.ArgumentParser) -> None:
    from appliance.admin_client import DEFAULT_URL, TOKEN_ENV

    p.add_argument("--url", type=http_url, default=DEFAULT_URL,
                   help=f"gateway URL (http://HOST:PORT or HOST:PORT); the admin token comes from ${TOKEN_ENV} or "
                        "the admin-token file `appliance up` writes")


def _call(url: str, method: str, path: str) -> dict[str, Any]:
    """One admin call; its failures are one clear line on stderr: exit code 2 when there is no admin token to
    send (nothing was tried), 1 when the appliance cannot be reached or refuses."""
    from appliance import admin_client

    if not admin_client.admin_token():
        raise CLIError(admin_client.no_token_message(), EXIT_USAGE)
    try:
        return admin_client.call(url, method, path)
    except admin_client.AdminError as exc:
        raise CLIError(str(exc)) from None


def cmd_status(args: argparse.Namespace) -> int:
    from appliance.admin_client import format_status

    status = _call(args.url, "GET", "/admin/status")
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    action = "undrain" if args.undo else "drain"
    result = _call(args.url, "POST", f"/admin/replicas/{args.replica}/{action}")
    print(f"{result['name']}: {result['state']}, {result['outstanding']} request(s) in flight")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    if bool(args.rolling) == bool(args.replica):
        raise CLIError("give a REPLICA or --rolling (not both)", EXIT_USAGE)
    path = "/admin/rolling-restart" if args.rolling else f"/admin/replicas/{args.replica}/restart"
    result = _call(args.url, "POST", path)
    what = "rolling restart of " + ", ".join(result.get("replicas", [])) if args.rolling else args.replica
    print(f"{what}: accepted (each replica drains first); follow with `appliance status`")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    result = _call(args.url, "POST", "/admin/reload")
    if not result.get("changed"):
        print("reload: the configuration has no changes; nothing to do")
    elif not result.get("rolling_restart"):
        print(f"reload: {', '.join(result['changed'])} changed; applied at once (no restart)")
    else:
        print(f"reload: {', '.join(result['changed'])} changed; rolling restart accepted (one replica at a time); "
              "follow with `appliance status`")
    return 0
