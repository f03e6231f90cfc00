"""``appliance reload``: ask the running appliance to re-read its configuration and roll the replicas onto the new
engine settings. Registered by ``appliance.cli`` through ``register(subparsers)``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from appliance.admin_client import DEFAULT_URL, TOKEN_ENV, AdminError, call


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "reload", help="re-read the configuration given at start; roll replicas onto new engine settings",
        description="Re-reads the configuration file and environment the appliance was started with, validates "
                    "them, and restarts the replicas one at a time onto the new engine.* settings. Changes that "
                    "cannot roll (ports, host, replica count, model, gateway settings) are refused with the keys "
                    "listed; nothing changes then.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"gateway URL (default {DEFAULT_URL}); token from ${TOKEN_ENV}")
    p.set_defaults(handler=cmd_reload)


def cmd_reload(args: argparse.Namespace) -> int:
    try:
        result = call(args.url, "POST", "/admin/reload")
    except AdminError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 1
    if not result.get("changed"):
        print("reload: the configuration has no changes; nothing to do")
    else:
        print(f"reload: {', '.join(result['changed'])} changed; rolling restart accepted (one replica at a time); "
              "follow with `appliance status`")
    return 0
