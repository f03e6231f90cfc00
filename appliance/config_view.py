"""The effective configuration as ``appliance config`` prints it: secrets redacted unless asked for.

Secrets hide in more places than the keys named for them: credentials embedded in URLs (``http://user:pass@host``,
a token used as the user name ``http://tok@host``, ``?token=...``) anywhere in any setting; ``k=v`` pairs whose key
looks secret (``--api-key=X``, ``token=X``, ``password=X`` inside a longer value); vLLM flags passed through
``engine.extra_args`` (``--api-key X``); and JSON values there (``--kv-transfer-config '{"api_key": "X"}'``).
Redaction walks the whole dump, so a key added later is covered too.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from appliance.secret_files import SECRET_PAIRS
from appliance.settings import Settings

REDACTED = "<redacted>"
# "tokens" (max_num_batched_tokens) and "tokenizer" name sizes and paths, not secrets.
SECRET_WORDS = re.compile(r"key|token(?!s|izer)|secret|password|passwd|credential|auth", re.IGNORECASE)
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>,;]+")
# key=value (or key: value) where the key looks secret; the value runs to the next separator.
BEARER = re.compile(r"\b(Bearer|Basic)\s+(?!<redacted>)[^\s,;'\"]+", re.IGNORECASE)  # a header's value
SECRET_PAIR = re.compile(r"(?P<key>[A-Za-z_][\w.-]*)(?P<sep>\s*[=:]\s*)(?P<value>[^\s,;&'\"]+)")


def config_dump(settings: Settings, *, show_secrets: bool = False) -> dict[str, Any]:
    """``settings`` as plain data; with ``show_secrets`` False every secret is replaced by ``<redacted>``."""
    data = settings.model_dump(mode="json")
    if show_secrets:
        return data
    gateway = data["gateway"]
    for pair in SECRET_PAIRS:
        value = gateway[pair.value]
        if pair.many:
            gateway[pair.value] = [REDACTED] * len(value)
        else:
            gateway[pair.value] = REDACTED if value else None
    data["maintenance"]["grafana_token"] = REDACTED if settings.maintenance.grafana_token else None
    for tenant in data["tenants"]:
        tenant["api_keys"] = [REDACTED] * len(tenant["api_keys"])
    data["engine"]["extra_args"] = redact_argv(settings.engine.extra_args)
    return {k: _walk(v) for k, v in data.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-looking flags, URL credentials, secret ``k=v`` pairs and secret
    JSON values redacted (for printing)."""
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
        if arg.startswith("-") and eq:
            out.append(f"{flag}={redact_text(value)}")
            continue
        out.append(redact_text(arg))
    return out


def redact_text(text: str) -> str:
    """One value: a JSON object or array with its secret-keyed values redacted, else the text with URL credentials
    and secret ``k=v`` pairs redacted."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            parsed = json.loads(stripped)
        except ValueError:
            pass
        else:
            redacted = _redact_json(parsed)
            return text if redacted == parsed else json.dumps(redacted, separators=(",", ":"))
    text = URL.sub(lambda m: redact_url(m.group(0)), text)
    text = BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return SECRET_PAIR.sub(_redact_pair, text)


def redact_url(text: str) -> str:
    """``scheme://user:pass@host/?token=x`` -> the password (or a user name alone, often a token) and
    secret-looking query values redacted; else unchanged."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:
        return text
    netloc = parts.netloc
    if host is not None and "@" in netloc:
        where = netloc.rpartition("@")[2]
        if parts.password is not None:
            netloc = f"{parts.username}:{REDACTED}@{where}"
        elif parts.username:
            netloc = f"{REDACTED}@{where}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if SECRET_WORDS.search(k) else v) for k, v in pairs], safe="<>")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_pair(match: re.Match[str]) -> str:
    if not SECRET_WORDS.search(match.group("key")) or "://" in match.group(0) or match.group("value") == REDACTED:
        return match.group(0)
    return f"{match.group('key')}{match.group('sep')}{REDACTED}"


def _redact_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and SECRET_WORDS.search(k) and not isinstance(v, dict | list)
                else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _walk(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
