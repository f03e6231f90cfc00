"""Each tenant's own prefix cache on shared engines: the gateway sets vLLM's ``cache_salt`` per tenant.

Why: vLLM's prefix cache is shared by every request an engine serves, and a request's usage tells how much of its
prompt was served from it (``prompt_tokens_details.cached_tokens``). A tenant that can send prompts and read that
number can test guesses of another tenant's prompt block by block (a hit means someone sent that prefix). vLLM's
answer is ``cache_salt``: the salt enters the hash of a prompt's first block, so prompts under two salts share no
block. The gateway sets it on every request of a tenant, derived from the tenant, so no tenant's request can ever
hit another's blocks.

- The salt is HMAC-SHA256, keyed by the engine key (``gateway.engine_key``: every gateway in front of the same
  engines holds the same one, so they agree on each tenant's salt and the tenant's cache is one cache whichever
  gateway its requests come through; without an engine key, a plain SHA-256 of the same input), over the tenant's
  cache scope: ``tenant:<name>``, or ``group:<name>`` for the tenants of one ``cache_group``.
- A client's own ``cache_salt`` is folded in, not forwarded: the salt becomes the digest of (scope, client salt).
  A tenant can still partition its own cache (one salt per end user, as vLLM intends), and no value a client
  chooses can produce another scope's salt: the scope is the gateway's, not the client's. (Dropping it would
  take that partitioning away from the tenants who use it; forwarding it, as before, is what let a tenant join
  any cache.) The client's salt is checked as vLLM checks it (the route's schema), so a salt vLLM would refuse is
  still refused.
- A ``cache_group`` puts tenants that trust each other (one product's services, its batch and interactive keys) in
  one cache: a long system prompt they all send is computed once, not once per tenant. Each of them can then learn
  the others' prompts from ``cached_tokens``: group only tenants that may.
- While the API is open (no key at all), requests have no tenant and keep vLLM's shared cache and their own salt.

The router's prefix index keys on the same salt (``RoutingRequest.salt``), so prefix affinity sends a request only
where its tenant's blocks can be, never to a replica for another tenant's identical prompt.
"""

from __future__ import annotations

import hashlib
import hmac

from appliance.gateway.tenants.directory import Tenant, TenantDirectory
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import RequestHook

FIELD = "cache_salt"


def cache_scope(tenant: Tenant) -> str:
    """The cache a tenant's requests use: its own, or its group's (the prefixes keep the two apart)."""
    return f"group:{tenant.cache_group}" if tenant.cache_group else f"tenant:{tenant.name}"


def salt_for(key: bytes | None, scope: str, client_salt: str | None = None) -> str:
    """The salt of ``scope`` (and a client's own salt within it): 64 hex digits, inside vLLM's limits (at most
    128 characters, none of ``@ / \\`` or NUL). Each part is length-prefixed, so no two (scope, salt) pairs read
    the same."""
    message = _framed(scope) + (b"" if client_salt is None else _framed(client_salt))
    if key is None:
        return hashlib.sha256(b"appliance-cache-salt\x00" + message).hexdigest()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _framed(part: str) -> bytes:
    data = part.encode()
    return len(data).to_bytes(4, "big") + data


class CacheIsolation:
    """The hook: sets each tenant's ``cache_salt`` on its requests (the body and the router's view) as they
    arrive; touches nothing while the API is open."""

    name = "cache_isolation"

    def __init__(self, directory: TenantDirectory, key: str | None) -> None:
        self.directory = directory
        self._key = key.encode() if key else None
        self._salts: dict[str, str] = {}  # scope -> its salt (without a client salt), computed once

    def salt(self, tenant: Tenant, client_salt: str | None = None) -> str:
        scope = cache_scope(tenant)
        if client_salt is not None:
            return salt_for(self._key, scope, client_salt)
        found = self._salts.get(scope)
        if found is None:
            if len(self._salts) > 4096:  # scopes come from the configuration; bound it across reloads anyway
                self._salts.clear()
            found = self._salts[scope] = salt_for(self._key, scope)
        return found

    def start(self, exchange: Exchange) -> RequestHook | None:
        if self.directory.open:
            return None
        body = exchange.parsed()
        if body is None:
            return None
        client = body.get(FIELD)
        salt = self.salt(exchange.tenant, client if isinstance(client, str) and client else None)
        exchange.routing.salt = salt
        exchange.override(FIELD, salt)
        return None
