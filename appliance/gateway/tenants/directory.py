"""Who is calling: an API key -> its tenant. The gateway's one answer to "whose request is this", for accounting,
quotas and fair share; the tenant set is bounded by the configuration, so every label it feeds is too."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from appliance.gateway.tenants.settings import DEFAULT_TENANT, TenantSettings


@dataclass(frozen=True)
class Tenant:
    """What the data path needs of a tenant (its keys stay in the directory)."""

    name: str
    priority: int = 0
    weight: float = 1.0
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None


DEFAULT = Tenant(DEFAULT_TENANT)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantDirectory:
    """API keys -> tenants. Open (every request is ``default``) when no key is configured at all.

    Keys are held as SHA-256 digests and a presented key is compared against every one with
    ``hmac.compare_digest``, so neither a dictionary lookup nor an early exit reveals a near miss by its timing."""

    def __init__(self, tenants: Iterable[TenantSettings] = (), flat_keys: Iterable[str] = ()) -> None:
        self._keys: list[tuple[bytes, Tenant]] = []
        self._tenants: dict[str, Tenant] = {}
        self.update(tenants, flat_keys)

    def update(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str] = ()) -> None:
        """Take a new configuration (start, ``appliance reload``): keys, quotas, priorities and weights."""
        keys: list[tuple[bytes, Tenant]] = []
        by_name: dict[str, Tenant] = {}
        flat, configured = list(flat_keys), list(tenants)
        if flat or not configured:  # the flat keys' tenant, or everyone's while only flat keys (or none) are set
            by_name[DEFAULT_TENANT] = DEFAULT
            keys += [(_digest(key), DEFAULT) for key in flat]
        for entry in configured:
            tenant = Tenant(entry.name, entry.priority, entry.weight, entry.tokens_per_minute,
                            entry.requests_per_minute)
            by_name[tenant.name] = tenant
            keys += [(_digest(key), tenant) for key in entry.api_keys]
        self._keys, self._tenants = keys, by_name

    @property
    def open(self) -> bool:
        """No key configured: /v1 is open and every request is the default tenant's."""
        return not self._keys

    def identify(self, key: str | None) -> Tenant | None:
        """The tenant a bearer key belongs to; the default tenant while the API is open; None: not a key."""
        if self.open:
            return self._tenants[DEFAULT_TENANT]
        if key is None:
            return None
        presented = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def tenants(self) -> list[Tenant]:
        """Every configured tenant (the default one included), by name."""
        return [self._tenants[name] for name in sorted(self._tenants)]
