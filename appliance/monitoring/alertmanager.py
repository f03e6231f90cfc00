"""Render the Alertmanager configuration from its template (alerts/alertmanager.yml) and the environment.

Why structural rather than text substitution: a receiver whose webhook URL is not configured must become a
valid null receiver (no ``webhook_configs``), which text replacement cannot do without leaving ``url: ""``
that Alertmanager rejects; and secrets (the webhook's token) must never be able to break the YAML's shape.

    python -m appliance.monitoring.alertmanager alerts/alertmanager.yml --out var/alertmanager.yml
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from appliance.paths import ALERTS_DIR

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
KNOWN = frozenset({"APPLIANCE_PAGER_WEBHOOK_URL", "APPLIANCE_TICKET_WEBHOOK_URL", "APPLIANCE_WATCHDOG_WEBHOOK_URL",
                   "APPLIANCE_ALERTS_WEBHOOK_URL", "APPLIANCE_ALERTS_TOKEN"})
log = logging.getLogger(__name__)
HEADER = "# Rendered from alerts/alertmanager.yml by appliance.monitoring.alertmanager: do not edit.\n"


class TemplateError(ValueError):
    """The template uses a placeholder nobody fills, or one where it cannot be filled structurally."""


def placeholders(template: str) -> set[str]:
    return set(PLACEHOLDER.findall(template))


def render_alertmanager_config(template: str, env: Mapping[str, str]) -> str:
    """The Alertmanager YAML for this environment.

    A webhook config is kept only when every variable it uses is set and not empty: an unset URL (or, for the
    appliance's own receiver, an unset alerts token, without which /admin/alerts answers 403) drops it, with a warning
    when its URL was set. A receiver left without webhook configs is a valid null receiver.
    """
    config = yaml.safe_load(template)
    unknown = placeholders(yaml.safe_dump(config)) - KNOWN  # values only: comments may mention ${VAR}
    if unknown:
        raise TemplateError(f"unknown placeholders in the Alertmanager template: {sorted(unknown)}; "
                            f"known: {sorted(KNOWN)}")
    for receiver in config.get("receivers", []):
        kept = []
        for hook in receiver.get("webhook_configs", []):
            if not _value(hook.get("url", ""), env):
                continue
            missing = sorted(name for name in placeholders(yaml.safe_dump(hook)) if not env.get(name))
            if missing:
                log.warning("Alertmanager receiver %r: %s unset, so its webhook is dropped",
                            receiver["name"], ", ".join(missing))
                continue
            kept.append(_fill(hook, env))
        receiver.pop("webhook_configs", None)
        if kept:
            receiver["webhook_configs"] = kept
    leftover = placeholders(yaml.safe_dump(config))
    if leftover:
        raise TemplateError(f"placeholders outside a webhook config are not supported: {sorted(leftover)}")
    return HEADER + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)


def _value(text: str, env: Mapping[str, str]) -> str:
    """``text`` with its placeholders replaced; empty when it is only a placeholder that is unset."""
    return PLACEHOLDER.sub(lambda m: env.get(m.group(1), "") or "", str(text)).strip()


def _fill(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {key: _fill(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_fill(item, env) for item in node]
    if isinstance(node, str) and PLACEHOLDER.search(node):
        return _value(node, env)
    return node


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.monitoring.alertmanager",
                                     description="Render the Alertmanager config template from the environment.")
    parser.add_argument("template", type=Path, nargs="?", default=ALERTS_DIR
                        / "alertmanager.yml")
    parser.add_argument("--out", type=Path, help="write here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = render_alertmanager_config(args.template.read_text(), os.environ)
    except TemplateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
