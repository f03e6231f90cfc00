"""Value types the settings sections share, so each is parsed one way wherever it appears."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BeforeValidator
from pydantic_settings import NoDecode


def split_commas(value: Any) -> Any:
    """A comma-separated string (a list's form in the environment: ``APPLIANCE_GATEWAY__API_KEYS=k1,k2``) as its
    stripped, non-empty items; anything else (a YAML list) as it is, for the field's own validation."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def blank_is_unset(value: Any) -> Any:
    """An empty or blank string means unset (None): compose passes an unset variable as "" (``APPLIANCE_MODEL=``,
    ``APPLIANCE_ADMIN_TOKEN_FILE=``), which as a path would be the current folder."""
    return None if isinstance(value, str) and not value.strip() else value


def redacted_url(url: str) -> str:
    """A server's URL as logs, status and errors show it: scheme, host, port and path; no user name or password,
    no query (which may hold credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# A list of strings given as a YAML list or, in the environment, comma-separated (NoDecode: not parsed as JSON).
CommaList = Annotated[list[str], NoDecode, BeforeValidator(split_commas)]
