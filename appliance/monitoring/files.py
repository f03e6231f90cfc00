"""Generated files: written whole, and compared with what is committed.

The rule files and the dashboards are both generated from code and alerts/config.yaml, and both are committed so
that reviewers read the result. One staleness check and one ``--write``/``--check`` entry serve both generators;
files are written with the appliance's one atomic writer (``appliance.files``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from appliance.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from appliance.files import atomic_write_text
from appliance.monitoring.config import CONFIG_PATH, MonitoringConfig, MonitoringConfigError, load_config

EXIT_STALE = EXIT_FAILED


def stale_diffs(rendered: Mapping[str, str], directory: Path) -> list[str]:
    """One unified diff per file in ``directory`` that differs from its rendering (a missing file included)."""
    diffs = []
    for name, text in rendered.items():
        path = directory / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diffs.append("".join(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                                      f"committed/{name}", f"rendered/{name}")))
    return diffs


def write_files(rendered: Mapping[str, str], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered.items():
        atomic_write_text(directory / name, text, mode=0o644)
        written.append(directory / name)
    return written


def generator_main(argv: Sequence[str] | None, *, prog: str, description: str, dir_flag: str, default_dir: Path,
                   render: Callable[[MonitoringConfig], Mapping[str, str]]) -> int:
    """``--write`` / ``--check`` of one generator: exit 0 written or current, 1 stale (with a diff), 2 when
    alerts/config.yaml cannot be used (one line on stderr)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the generated files")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when the committed files are stale")
    parser.add_argument(dir_flag, dest="directory", type=Path, default=default_dir,
                        help=f"folder of the generated files (default {default_dir})")
    parser.add_argument("--config", type=Path, default=CONFIG_PATH, help=f"monitoring config (default {CONFIG_PATH})")
    args = parser.parse_args(argv)
    try:
        rendered = render(load_config(args.config))
    except MonitoringConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.write:
        for path in write_files(rendered, args.directory):
            print(path)
        return EXIT_OK
    diffs = stale_diffs(rendered, args.directory)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print(f"{len(diffs)} generated file(s) stale: run python -m {prog.split()[-1]} --write", file=sys.stderr)
        return EXIT_STALE
    return EXIT_OK
