"""What every command module shares: how a subcommand is added, the --config flag, settings, logging."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.exit_codes import EXIT_FAILED, EXIT_USAGE

if TYPE_CHECKING:
    from appliance.settings import Settings

Handler = Callable[[argparse.Namespace], int]


class CLIError(Exception):
    """A failure the user can act on: printed as one line, with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it tells the reader something: not ``None`` or an empty list (the help says
    what happens then), not the value of an on/off flag (its default is the opposite of giving it), and not
    when the help already explains its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or default in ((), [], "")
                or action.nargs == 0 or "default" in text.lower()):
            return text
        return super()._get_help_string(action)


def add_command(sub: Any, name: str, help: str, handler: Handler, *, config: bool = False,
                description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose --help shows its meaningful defaults; ``config`` adds the --config flag."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description or help,
                                                     formatter_class=HelpFormatter)
    parser.set_defaults(handler=handler)
    if config:
        parser.add_argument("--config", type=Path, default=None,
                            help="YAML settings file (APPLIANCE_* environment variables win)")
    return parser


def load(args: argparse.Namespace) -> Settings:
    from appliance.settings import load_settings

    return load_settings(getattr(args, "config", None))


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":  # libraries that log every request or job at INFO drown the appliance's own lines
        for noisy in ("httpx", "apscheduler"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def admin_call(url: str, method: str, path: str) -> dict[str, Any]:
    """One admin call; its failures are one clear line on stderr: exit code 2 when there is no admin token to
    send (nothing was tried), 1 when the appliance cannot be reached or refuses."""
    from appliance import admin_client

    if not admin_client.admin_token():
        raise CLIError(admin_client.no_token_message(), EXIT_USAGE)
    try:
        return admin_client.call(url, method, path)
    except admin_client.AdminError as exc:
        raise CLIError(str(exc)) from None
