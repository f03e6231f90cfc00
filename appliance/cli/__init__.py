"""The ``appliance`` command line. Each subcommand is a thin shell over a module that does the work.

One way to add a command: a module with ``register(subparsers)`` (see ``COMMANDS``), whose parsers are made
with ``add_command`` so meaningful defaults show in ``--help`` (``build_parser`` gives every command the same
formatter and, lacking one, its summary as description). URL options take ``argtypes.http_url`` or
``argtypes.host_port``. Errors a user can fix are one line on stderr and an exit code from
``appliance.exit_codes``, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from appliance import version
from appliance.cli.common import CLIError, HelpFormatter
from appliance.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE

# Modules that register subcommands, in the order `appliance --help` lists them.
COMMANDS = (
    "appliance.cli.serve",
    "appliance.cli.admin",
    "appliance.cli.batches",
    "appliance.cli.model",
    "appliance.cli.loadtest",
    "appliance.monitoring.snapshot",
    "appliance.monitoring.kubernetes",
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.handler(args) or 0)
    except CLIError as exc:
        print(f"appliance {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a user error the command did not anticipate is still one line
        user_error = _user_error(exc)
        if user_error is None:
            raise
        print(f"appliance {args.command}: {user_error}", file=sys.stderr)
        return EXIT_USAGE if _is_usage(exc) else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="Observability-first LLM inference appliance")
    parser.add_argument("--version", action="version", version=f"appliance {version()}")
    sub = parser.add_subparsers(title="commands", dest="command")
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    summaries = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():  # however a command was added: its defaults, and a description
        command.formatter_class = HelpFormatter
        if not (command.description or "").strip():
            command.description = summaries.get(name)
    return parser


def _user_error(exc: Exception) -> str | None:
    """The one-line message for errors caused by the configuration or the host, not by a bug."""
    from appliance.engine.placement import PlacementError
    from appliance.settings import ConfigError

    if isinstance(exc, (ConfigError, PlacementError)):
        return str(exc)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or exc}{where}"
    return None


def _is_usage(exc: Exception) -> bool:
    from appliance.settings import ConfigError

    return isinstance(exc, ConfigError)
