"""The effective configuration as ``appliance config`` prints it: secrets redacted unless asked for.

Secrets hide in more places than the keys named for them: credentials embedded in URLs
(``http://user:pass@host``, ``?token=...``) in any setting, and vLLM flags passed through ``engine.extra_args``
(``--api-key X``, ``--hf-token=X``). Redaction walks the whole dump, so a key added later is covered too.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from appliance.settings import Settings

REDACTED = "<redacted>"
SECRET_WORDS = re.compile(r"key|token|secret|password|passwd|credential|auth", re.IGNORECASE)


def config_dump(settings: Settings, *, show_secrets: bool = False) -> dict[str, Any]:
    """``settings`` as plain data; with ``show_secrets`` False every secret is replaced by ``<redacted>``."""
    data = settings.model_dump(mode="json")
    if show_secrets:
        return data
    data["api_keys"] = [REDACTED] * len(settings.api_keys)
    data["admin_token"] = REDACTED if settings.admin_token else None
    data["maintenance"]["grafana_token"] = REDACTED if settings.maintenance.grafana_token else None
    data["engine"]["extra_args"] = redact_argv(settings.engine.extra_args)
    return _walk(data)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-looking flags and URL credentials redacted (for printing)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, value = arg.partition("=")
        if arg.startswith("-") and SECRET_WORDS.search(flag):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_url(arg))
    return out


def redact_url(text: str) -> str:
    """``scheme://user:pass@host/?token=x`` -> password and secret-looking query values redacted; else unchanged."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:
        return text
    netloc = parts.netloc
    if parts.password is not None and host is not None:
        netloc = f"{parts.username}:{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if SECRET_WORDS.search(k) else v) for k, v in pairs], safe="<>")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _walk(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value
