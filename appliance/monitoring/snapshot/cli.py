"""``appliance snapshot``'s command line: arguments, one-line errors, the exit code."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from appliance.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from appliance.monitoring.dashboards import DASHBOARDS, DASHBOARDS_DIR
from appliance.monitoring.snapshot.take import SnapshotRequest, snapshot
from appliance.monitoring.snapshot.timerange import SnapshotError

EXIT_QUERY_FAILED = EXIT_FAILED  # some panel's query failed: the snapshot is written, incomplete


def _variable(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"\w+", name):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=REGEX, e.g. replica=replica-0")
    return name, value


def register(sub: Any) -> None:
    """Add ``snapshot`` to the appliance's argparse subparsers."""
    p = sub.add_parser("snapshot", help="render a dashboard's panels from Prometheus to PNG + HTML",
                       description="Run every panel's queries of a dashboard against Prometheus and write "
                                   "index.html, results.json and panels/*.png to --out (atomically).")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--dashboard", required=True,
                   help=f"dashboard uid: {', '.join(DASHBOARDS)}")
    p.add_argument("--from", dest="start", default="-1h", help="now-1h, -30m, Unix seconds or ISO 8601 "
                                                              "(default -1h)")
    p.add_argument("--to", dest="end", default="now", help="same forms (default now)")
    p.add_argument("--step", help="query resolution, e.g. 15s (default: range / 240, at least the scrape "
                                  "interval)")
    p.add_argument("--rate-interval", help="value of $__rate_interval (default: Grafana's max(step + scrape "
                                           "interval, 4 x scrape interval))")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus scrape interval, seconds")
    p.add_argument("--var", dest="variables", action="append", type=_variable, default=[],
                   metavar="NAME=REGEX", help="dashboard variable (default .* = All), e.g. replica=replica-0")
    p.add_argument("--dashboards-dir", type=Path, help=f"folder of dashboard JSON (default {DASHBOARDS_DIR})")
    p.add_argument("--timeout", type=float, default=30.0, help="per-query timeout, seconds")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier snapshot")
    p.add_argument("--out", type=Path, required=True, help="output folder (created; must be empty or absent)")
    # argparse reads "--from -1h" as two options unless "-1h" looks like a negative number to it; teach this
    # parser that relative times are values (it has no options that look like them).
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-\d+(?:\.\d+)?(?:ms|[smhdw])?(?:\d+(?:\.\d+)?(?:ms|[smhdw]))*$")
    p.set_defaults(handler=cmd_snapshot)


def cmd_snapshot(args: argparse.Namespace) -> int:
    request = SnapshotRequest(prometheus=args.prometheus, dashboard=args.dashboard, out=args.out, start=args.start,
                              end=args.end, step=args.step, rate_interval=args.rate_interval,
                              scrape_interval=args.scrape_interval, variables=dict(args.variables),
                              dashboards_dir=args.dashboards_dir, timeout=args.timeout,
                              overwrite=args.overwrite)
    try:
        document = snapshot(request)
    except SnapshotError as exc:
        print(f"appliance snapshot: {exc}", file=sys.stderr)
        return EXIT_USAGE
    counts: dict[str, int] = {}
    for panel in document["panels"]:
        counts[panel["status"]] = counts.get(panel["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{args.out / 'index.html'}: {len(document['panels'])} panels ({summary})")
    return EXIT_QUERY_FAILED if counts.get("error") else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance")
    register(parser.add_subparsers())
    args = parser.parse_args(["snapshot", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.handler(args)
    return code
