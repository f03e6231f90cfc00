"""Who is calling: an API key -> its tenant. The gateway's one answer to "whose request is this", for accounting,
quotas and fair share; the tenant set is bounded by the configuration, so every label it feeds is too."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.gateway.tenants.settings import DEFAULT_TENANT, TenantSettings
from appliance.http.credentials import digest


@dataclass(frozen=True)
class Tenant:
    """What the data path needs of a tenant (its keys stay in the directory)."""

    name: str
    priority: int = 0
    weight: float = 1.0
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    cache_group: str | None = None  # tenants of one group share a prefix cache (tenants/isolation.py)


DEFAULT = Tenant(DEFAULT_TENANT)


def _digest(key: str) -> bytes:
    return digest(key)


def present(tenants: Iterable[TenantSettings], flat_keys: Iterable[str] = ()) -> set[str]:
    """The tenants a configuration has: each configured one, and ``default`` with flat keys or with no tenant."""
    configured = [entry.name for entry in tenants]
    return {*configured, DEFAULT_TENANT} if list(flat_keys) or not configured else set(configured)


def owners(tenants: Iterable[TenantSettings], flat_keys: Iterable[str] = ()) -> dict[str, str]:
    """API key -> the name of the tenant it belongs to, in a configuration."""
    found = dict.fromkeys(flat_keys, DEFAULT_TENANT)
    for entry in tenants:
        found.update(dict.fromkeys(entry.api_keys, entry.name))
    return found


class TenantDirectory:
    """API keys -> tenants. Open (every request is ``default``) when no key is configured at all.

    Keys are held as SHA-256 digests and a presented key is compared against every one with
    ``hmac.compare_digest``, so neither a dictionary lookup nor an early exit reveals a near miss by its timing.

    A reload that replaces a tenant's keys keeps the replaced ones for ``overlap_seconds`` (its clients move to the
    new key without a refused request); a tenant the reload removes loses its keys at once (revoked, not rotated)."""

    def __init__(self, tenants: Iterable[TenantSettings] = (), flat_keys: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: list[tuple[bytes, Tenant]] = []
        self._retired: list[tuple[bytes, str, float]] = []  # replaced keys: digest, tenant name, accepted until
        self._tenants: dict[str, Tenant] = {}
        self.update(tenants, flat_keys)

    def update(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str] = (), *,
               overlap_seconds: float = 0.0) -> None:
        """Take a new configuration (start, ``appliance reload``): keys, quotas, priorities and weights."""
        keys: list[tuple[bytes, Tenant]] = []
        by_name: dict[str, Tenant] = {}
        flat, configured = list(flat_keys), list(tenants)
        if flat or not configured:  # the flat keys' tenant, or everyone's while only flat keys (or none) are set
            by_name[DEFAULT_TENANT] = DEFAULT
            keys += [(_digest(key), DEFAULT) for key in flat]
        for entry in configured:
            tenant = Tenant(entry.name, entry.priority, entry.weight, entry.tokens_per_minute,
                            entry.requests_per_minute, entry.cache_group)
            by_name[tenant.name] = tenant
            keys += [(_digest(key), tenant) for key in entry.api_keys]
        self._retired = self._still_retired(keys, by_name, overlap_seconds)
        self._keys, self._tenants = keys, by_name

    def _still_retired(self, keys: list[tuple[bytes, Tenant]], by_name: dict[str, Tenant],
                       overlap_seconds: float) -> list[tuple[bytes, str, float]]:
        """The keys a new configuration replaces but keeps for a while: those of tenants it still has, not
        configured again; earlier replaced ones keep their own deadline, or the new overlap's if it ends first."""
        now, current = self._clock(), {digest_ for digest_, _ in keys}
        kept = [(d, name, min(until, now + overlap_seconds)) for d, name, until in self._retired
                if min(until, now + overlap_seconds) > now and name in by_name and d not in current]
        if overlap_seconds > 0:
            known = {d for d, _, _ in kept}
            kept += [(d, tenant.name, now + overlap_seconds) for d, tenant in self._keys
                     if tenant.name in by_name and d not in current and d not in known]
        return kept

    @property
    def open(self) -> bool:
        """No key configured: /v1 is open and every request is the default tenant's."""
        return not self._keys

    def identify(self, key: str | None) -> Tenant | None:
        """The tenant a bearer key belongs to (a replaced key's within its overlap window); the default tenant while
        the API is open; None: not a key."""
        if self.open:
            return self._tenants[DEFAULT_TENANT]
        if key is None:
            return None
        presented = _digest(key)
        found: Tenant | None = None
        for digest_, tenant in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(presented, digest_):
                found = tenant
        if self._retired:
            now = self._clock()
            for digest_, name, until in self._retired:
                if hmac.compare_digest(presented, digest_) and until > now and found is None:
                    found = self._tenants.get(name)
        return found

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def tenants(self) -> list[Tenant]:
        """Every configured tenant (the default one included), by name."""
        return [self._tenants[name] for name in sorted(self._tenants)]
