"""A hot reload of tenants, keys and tokens (``appliance reload``; ``appliance.maintenance.reload.HOT_KEYS``),
applied at once to whoever keeps them in this process: the gateway's tenant directory, quotas and accounting, the
keyring the credential checks read, and the live settings. The same for the gateway and for each of its workers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from appliance.context import LiveState
from appliance.gateway.tenants.directory import TenantDirectory, present
from appliance.gateway.tenants.settings import TenantSettings
from appliance.http.credentials import API_KEYS, Credentials, Keyring
from appliance.maintenance.reload import HOT_KEYS
from appliance.settings import Settings


class TenantsOwner(Protocol):
    """Whoever keeps a tenant directory that a reload updates (the gateway, or a worker's request path)."""

    @property
    def tenants(self) -> TenantDirectory: ...

    def update_tenants(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str], *,
                       overlap_seconds: float = 0.0) -> list[str]: ...


def hot_reload(gateway: TenantsOwner, keyring: Keyring, live: LiveState) -> Callable[[Settings], None]:
    """``appliance reload`` of tenants, keys and tokens, at once: the gateway's directory, quotas and accounting,
    and the keyring the credential checks read. A replaced secret stays valid for ``gateway.secret_overlap_seconds``;
    a removed tenant's keys do not."""
    def apply_hot(new: Settings) -> None:
        overlap = new.gateway.secret_overlap_seconds
        keep = rotated_not_revoked(keyring.current(), gateway.tenants, new)
        gateway.update_tenants(new.tenants, new.gateway.api_keys, overlap_seconds=overlap)
        keyring.rotate(new.credentials, overlap, keep)
        live.replace(live.settings.replaced({key: new.value_at(key) for key in HOT_KEYS}))
    return apply_hot


def rotated_not_revoked(before: Credentials, directory: TenantDirectory, new: Settings) -> Callable[[str, str], bool]:
    """Which replaced secrets a reload to ``new`` keeps for the overlap window: every token; an API key only while
    its tenant (as ``directory`` knows it before the reload) is still configured, since a removed tenant's keys are
    revoked, not rotated."""
    owner = {key: tenant.name for key in {*before.current(API_KEYS), *(r.value for r in before.retired)}
             if (tenant := directory.identify(key)) is not None}
    still = present(new.tenants, new.gateway.api_keys)
    return lambda role, value: role != API_KEYS or owner.get(value) in still
