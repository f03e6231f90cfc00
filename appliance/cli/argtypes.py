"""Argument types for every command: a bad value is an argparse error (exit 2, a usage line, no traceback)."""

from __future__ import annotations

import argparse
from urllib.parse import SplitResult, urlsplit


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def non_negative_float(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else positive_float(text)


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be within (0, 1]")
    return value


def confidence(text: str) -> float:
    value = fraction(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{value} must be below 1")
    return value


def int_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(",") if part.strip())




# --- URLs: one parser for every --url, --gateway, --metrics-url ... option ---------------------------------------

_URL_FORMS = "expected http(s)://HOST[:PORT][/PATH] or HOST:PORT"


def _split_url(text: str) -> SplitResult:
    """``http://host:8000/x``, ``https://host`` or a bare ``host:8000`` (read as http); anything else is an error."""
    value = text.strip()
    bare = "://" not in value
    parts = urlsplit(f"http://{value}" if bare else value)
    try:
        port = parts.port  # a port that is not a number in 0-65535 raises here
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has no valid port: {_URL_FORMS}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or (bare and port is None):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {_URL_FORMS}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise argparse.ArgumentTypeError(f"{text!r}: no query, fragment or credentials, please ({_URL_FORMS})")
    return parts


def http_url(text: str) -> str:
    """An http(s) base URL, normalized: ``localhost:8000`` -> ``http://localhost:8000``, no trailing slash."""
    parts = _split_url(text)
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def host_port(text: str) -> str:
    """``HOST:PORT`` as Prometheus targets name an endpoint; ``http://HOST:PORT`` is accepted and stripped."""
    parts = _split_url(text)
    if parts.scheme != "http" or parts.path.strip("/"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT (or http://HOST:PORT, no path)")
    return parts.netloc


def optional_host_port(text: str) -> str:
    """``host_port``, or the empty string for none."""
    return "" if not text.strip() else host_port(text)
