"""``tenants``: the teams and services that share one appliance, each with its own API keys, quotas and share.

Set in YAML as a list, or as JSON in ``APPLIANCE_TENANTS``. The flat ``api_keys`` keep working: they are the keys
of one tenant named ``default`` (so no configured tenant may take that name while flat keys are set).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.secret_files import read_keys_file, read_secret_file
from appliance.setting_types import blank_is_unset, redacted_url

DEFAULT_TENANT = "default"  # the flat api_keys' tenant, and everyone's while the API is open (no keys at all)
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"  # a Prometheus label value an SRE can type; bounded length


class TenantSettings(BaseModel):
    """One tenant: its keys, its quotas (none: unlimited), its priority and its weight in fair share."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN, description="The tenant's name, as metrics and logs show it "
                      "(lower case letters, digits, _ . -; at most 63 characters).")
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys that identify this tenant on /v1.")
    api_keys_file: Path | None = Field(
        None, description="File holding this tenant's keys, one a line (blank lines and # comments ignored); not "
        "with api_keys. Read again on `appliance reload`."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt plus completion tokens per minute (a token bucket holding one minute's "
        "worth). Each request reserves its worst case (its prompt, max_tokens x n per prompt) and is settled to "
        "its usage at the end; one that does not fit now: 429 rate_limit_exceeded with Retry-After; one that can "
        "never fit: 400 exceeds_quota. Unset: unlimited."
    )
    requests_per_minute: int | None = Field(
        None, ge=1, description="Sequences per minute (a bucket holding one minute's worth): a request counts "
        "prompts x n. Unset: unlimited."
    )
    priority: int = Field(
        0, ge=0, le=9, description="Queue order between tenants: a waiting request of a higher priority goes "
        "first; fair share applies among tenants of one priority."
    )
    weight: float = Field(
        1.0, gt=0, le=1000, description="Share among tenants of one priority: a tenant of weight 2 is served twice "
        "the tokens of a tenant of weight 1 while both wait."
    )
    cache_group: str | None = Field(
        None, pattern=NAME_PATTERN, description="Tenants naming the same group share one prefix cache on the "
        "engines (their common prompts are computed once; each can tell, from cached_tokens, what the others sent). "
        "Unset: the tenant's cache is its own."
    )

    @field_validator("api_keys_file", mode="before")
    @classmethod
    def _empty_file_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @model_validator(mode="after")
    def _keys(self) -> TenantSettings:
        """Keys from the file (read whenever settings are built: start and reload); at least one key."""
        if self.api_keys_file is not None:
            if self.api_keys:
                raise ValueError(f"tenant {self.name}: api_keys and api_keys_file are both set: set one")
            self.api_keys = read_keys_file(self.api_keys_file, setting=f"tenants[{self.name}].api_keys_file")
        self.api_keys = [key.strip() for key in self.api_keys if key.strip()]
        if not self.api_keys:
            raise ValueError(f"tenant {self.name}: no API key (set api_keys or api_keys_file)")
        return self


def check_tenants(tenants: list[TenantSettings], flat_keys: list[str]) -> None:
    """Names unique, ``default`` left to the flat keys when they are set, and each key names one tenant only
    (else a request's tenant would depend on the order of a list). Raises ValueError naming the conflict, never
    the key."""
    names = [tenant.name for tenant in tenants]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tenants: names must be unique: {', '.join(duplicates)}")
    if flat_keys and DEFAULT_TENANT in names:
        raise ValueError(f"tenants: '{DEFAULT_TENANT}' is the tenant of the flat api_keys; name the tenant "
                         "otherwise, or move the flat keys into it")
    owners: dict[str, str] = {key: DEFAULT_TENANT for key in flat_keys}
    for tenant in tenants:
        for key in tenant.api_keys:
            other = owners.setdefault(key, tenant.name)
            if other != tenant.name:
                raise ValueError(f"tenants: one API key belongs to both {other} and {tenant.name}")


class QuotaStoreSettings(BaseModel):
    """``quota_store``: where the tenants' quota buckets live. ``memory``: in this gateway's process (one gateway);
    ``redis``: one Redis shared by every gateway that points at it, so several gateways hold a tenant to one
    quota (docs/tenants.md, "One quota across gateways")."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["memory", "redis"] = Field(
        "memory", description="memory: each gateway keeps its own buckets (one gateway: the default). redis: the "
        "buckets live in the Redis at url, shared by every gateway pointing at it (several gateways)."
    )
    url: str = Field(
        "redis://localhost:6379/0", description="The Redis (redis:// or rediss:// for TLS, with its database "
        "number). No password here: set password_file."
    )
    password_file: Path | None = Field(
        None, description="File holding the Redis password (a mounted secret; read at start and on reload, used "
        "by the connection made at start)."
    )
    timeout_seconds: float = Field(
        0.25, gt=0, le=10, description="Longest one call to the store may take (connect included); longer: the "
        "store counts as unreachable for that request."
    )
    failure: Literal["open", "closed"] = Field(
        "open", description="When the store is unreachable. open: requests are admitted without their quota "
        "checked; closed: refused with 503 quota_store_unavailable and Retry-After. Either way counted "
        "(appliance_quota_store_unchecked_requests_total) and alerted (QuotaStoreUnreachable)."
    )
    retry_after_seconds: int = Field(
        5, ge=1, le=3600, description="Retry-After of the 503 a request gets while the store is unreachable and "
        "failure is closed."
    )
    probe_seconds: float = Field(
        1.0, gt=0, le=60, description="How often the gateway PINGs the store (its state stays true while no "
        "request comes); while the store is unreachable, one request in this many seconds tries it again, the "
        "others fail at once instead of each waiting timeout_seconds."
    )
    key_prefix: str = Field(
        "appliance:quota", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9:_.-]+$",
        description="Prefix of the store's keys (one key a tenant: <prefix>:<tenant>), so appliances sharing one "
        "Redis keep apart; gateways sharing a quota use the same prefix."
    )
    drain_seconds: float = Field(
        2.0, ge=0, le=60, description="At shutdown, how long the gateway waits for the settles still in flight to "
        "reach the store."
    )

    _password: str | None = None

    @field_validator("password_file", mode="before")
    @classmethod
    def _empty_file_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @model_validator(mode="after")
    def _read_password(self) -> QuotaStoreSettings:
        if urlsplit(self.url).password:
            raise ValueError("quota_store.url holds a password: set quota_store.password_file instead")
        if urlsplit(self.url).scheme not in ("redis", "rediss"):
            raise ValueError("quota_store.url: a redis:// or rediss:// URL")
        self._password = (read_secret_file(self.password_file, setting="quota_store.password_file")
                          if self.password_file is not None else None)
        return self

    @property
    def password(self) -> str | None:
        return self._password

    @property
    def redacted_url(self) -> str:
        """The URL as logs show it (no user name)."""
        return redacted_url(self.url)
