"""Secrets read from files (``admin_token_file``, ``api_keys_file``, ``alerts_token_file``, ``metrics_token_file``,
``lease_token_file``, ``engine_key_file``: keys of the gateway section).

Why files: an environment variable is inherited by every child process and shown by ``docker inspect`` and
``kubectl describe``; a file mounted from a compose secret or a Kubernetes Secret volume is readable by the one
process that needs it and nothing else. The settings validator calls :func:`resolve_secrets` each time settings
are built (start, and ``appliance reload``), so a file is read whenever the configuration is.

Errors name the setting and the file, never its content.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class SecretFileError(ValueError):
    """A secret file is missing, unreadable or empty, or a secret is set both directly and from a file."""


@dataclass(frozen=True)
class SecretPair:
    """A secret setting and the setting naming the file it may come from instead."""

    value: str  # e.g. "admin_token"
    many: bool = False  # api_keys: one key a line
    flat: bool = True  # also a top-level key (an earlier name, APPLIANCE_ADMIN_TOKEN); False: gateway.<value> only

    @property
    def file(self) -> str:
        return f"{self.value}_file"

    @property
    def env(self) -> str:
        """The variable that sets it (its file: this plus ``_FILE``)."""
        return f"APPLIANCE_{self.value.upper()}" if self.flat else f"APPLIANCE_GATEWAY__{self.value.upper()}"


# lease_token: what node pods hold instead of the admin token (the restart lease, nothing else); engine_key: what
# the gateway presents to the engines, which refuse every other caller (docs/security.md).
SECRET_PAIRS = (SecretPair("admin_token"), SecretPair("api_keys", many=True), SecretPair("alerts_token"),
                SecretPair("metrics_token"), SecretPair("lease_token", flat=False),
                SecretPair("engine_key", flat=False))


def read_secret_file(path: Path, *, setting: str) -> str:
    """The file's content without surrounding whitespace (the trailing newline editors add)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SecretFileError(f"{setting}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{setting}: {path} cannot be read ({type(exc).__name__}: "
                              f"{getattr(exc, 'strerror', None) or 'not UTF-8 text'})") from None
    secret = text.strip()
    if not secret:
        raise SecretFileError(f"{setting}: {path} is empty")
    return secret


def read_keys_file(path: Path, *, setting: str) -> list[str]:
    """One key a line; blank lines and lines starting with ``#`` are ignored; at least one key."""
    keys = [line.strip() for line in read_secret_file(path, setting=setting).splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise SecretFileError(f"{setting}: {path} holds no key (one key a line; blank lines and # comments are "
                              "ignored)")
    return keys


def resolve_secrets(values: dict[str, object]) -> dict[str, object]:
    """The updates that fill each secret from its file; raises SecretFileError for a secret set both ways or a
    file that cannot give one. ``values``: the settings' current values by name."""
    updates: dict[str, object] = {}
    for pair in SECRET_PAIRS:
        path = values.get(pair.file)
        if path is None:
            continue
        if values.get(pair.value):
            raise SecretFileError(f"{pair.value} and {pair.file} are both set: set one (the secret itself, "
                                  f"{pair.env}, or the file holding it, {pair.env}_FILE)")
        path = Path(str(path))
        updates[pair.value] = (read_keys_file(path, setting=pair.file) if pair.many
                               else read_secret_file(path, setting=pair.file))
    return updates
