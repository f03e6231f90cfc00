"""What the load-test tests share: the appliance command line as its console script runs it."""

from __future__ import annotations

from appliance.cli import main


def run_cli(argv: list[str]) -> int:
    """``appliance <argv>`` as the console script runs it: its exit code, errors on stderr."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
