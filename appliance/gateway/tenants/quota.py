"""Quotas: each tenant's ``tokens_per_minute`` and ``requests_per_minute`` as token buckets.

A bucket holds one minute's worth (its capacity) and refills continuously at capacity / 60 per second. A request
is checked before admission (before it queues): the requests bucket must hold one whole request, which it takes;
the tokens bucket must not be in debt. The tokens bucket is then charged as the request goes: an estimate of the
prompt on admission, one token per streamed content event, and the difference to the engine's own usage at the
end. That last charge may put the bucket in debt (a long answer costs what it cost): the debt is what makes the
tenant's next request wait, and ``Retry-After`` says for how long.

Levels survive a configuration reload (``Quotas.update``): a tenant in debt stays in debt, a new rate only changes
the capacity and the refill from now on, and a tenant (or a limit) removed and added back gets its bucket back as it
has refilled meanwhile, never a fresh full one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.gateway.tenants.directory import Tenant

Clock = Callable[[], float]
TOKENS, REQUESTS = "tokens", "requests"  # appliance_tenant_rate_limited_total's ``limit`` label
LIMITS = (TOKENS, REQUESTS)


class TokenBucket:
    """``per_minute`` units a minute: capacity ``per_minute``, refilled continuously; its level may go negative
    (debt) through ``charge``, never above capacity."""

    def __init__(self, per_minute: int, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.capacity = float(per_minute)
        self._level = self.capacity
        self._at = clock()

    @property
    def rate(self) -> float:
        """Units refilled per second."""
        return self.capacity / 60.0

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def _refill(self) -> None:
        now = self._clock()
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = max(self._at, now)

    def take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` if the bucket holds it; False (nothing taken) if not."""
        self._refill()
        if self._level < amount:
            return False
        self._level -= amount
        return True

    def charge(self, amount: float) -> None:
        """Charge ``amount`` whatever the level (debt allowed); a negative amount refunds, up to capacity."""
        self._refill()
        self._level = min(self.capacity, self._level - amount)

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds ``level`` (0: it does)."""
        missing = level - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def set_rate(self, per_minute: int) -> None:
        """A new capacity and refill from now on; the level is kept (clamped to the new capacity)."""
        self._refill()
        self.capacity = float(per_minute)
        self._level = min(self._level, self.capacity)


@dataclass(frozen=True)
class Refusal:
    """A request refused by a quota: which limit, the tenant's rate, and whole seconds until it can serve."""

    tenant: str
    limit: str  # TOKENS or REQUESTS
    per_minute: int
    retry_after: int

    @property
    def message(self) -> str:
        what = "tokens" if self.limit == TOKENS else "requests"
        return (f"tenant {self.tenant} is over its quota of {self.per_minute} {what} per minute; retry in "
                f"{self.retry_after} s")


class TenantQuota:
    """One tenant's buckets (None: that limit is not set)."""

    def __init__(self, tenant: Tenant, clock: Clock) -> None:
        self._clock = clock
        self.tokens: TokenBucket | None = None
        self.requests: TokenBucket | None = None
        self._unset: dict[str, TokenBucket] = {}  # buckets of limits a reload unset, kept while below capacity
        self.configure(tenant)

    def configure(self, tenant: Tenant) -> None:
        self.name = tenant.name
        self.tokens = self._bucket(TOKENS, self.tokens, tenant.tokens_per_minute)
        self.requests = self._bucket(REQUESTS, self.requests, tenant.requests_per_minute)

    def _bucket(self, limit: str, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        """The limit's bucket under its new rate. A limit that is unset keeps its bucket aside while it is below
        capacity, so setting the limit again does not forgive what was spent (a fresh bucket would start full)."""
        if per_minute is None:
            if bucket is not None and not full(bucket):
                self._unset[limit] = bucket
            return None
        bucket = bucket or self._unset.pop(limit, None)
        if bucket is None:
            return TokenBucket(per_minute, self._clock)
        bucket.set_rate(per_minute)
        return bucket

    def settled(self) -> bool:
        """Every bucket it has, or kept aside, is full: a fresh quota would be the same, so it may be dropped."""
        buckets = [b for b in (self.tokens, self.requests, *self._unset.values()) if b is not None]
        return all(full(bucket) for bucket in buckets)

    def admit(self, prompt_estimate: int) -> Refusal | None:
        """Check both limits; if both allow, take one request and charge the prompt's estimate."""
        if self.tokens is not None and self.tokens.level < 0:
            return self._refusal(TOKENS, self.tokens, 0.0)
        if self.requests is not None and not self.requests.take(1):
            return self._refusal(REQUESTS, self.requests, 1.0)
        if self.tokens is not None:
            self.tokens.charge(prompt_estimate)
        return None

    def charge(self, tokens: float) -> None:
        if self.tokens is not None and tokens:
            self.tokens.charge(tokens)

    def _refusal(self, limit: str, bucket: TokenBucket, needed: float) -> Refusal:
        wait = max(1, math.ceil(bucket.seconds_until(needed)))
        return Refusal(self.name, limit, int(bucket.capacity), wait)


def full(bucket: TokenBucket) -> bool:
    return bucket.level >= bucket.capacity


class Quotas:
    """Every tenant's buckets, by name; tenants without a quota have none (and cost nothing to check)."""

    def __init__(self, tenants: Iterable[Tenant] = (), clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._quotas: dict[str, TenantQuota] = {}
        self._idle: dict[str, TenantQuota] = {}  # quotas of tenants (or limits) a reload removed, not yet refilled
        self.update(tenants)

    def update(self, tenants: Iterable[Tenant]) -> None:
        """A new configuration (start, reload): rates change, levels stay; a new tenant's bucket starts full.

        A removed tenant's (or a removed limit's) bucket is kept aside until it has refilled, so that removing a
        tenant and adding it back does not forgive its debt; once full it goes, as a new one would start full
        anyway. What is kept is bounded by the tenants the configuration named, and shrinks as buckets refill."""
        previous = {**self._idle, **self._quotas}
        quotas: dict[str, TenantQuota] = {}
        for tenant in tenants:
            if tenant.tokens_per_minute is None and tenant.requests_per_minute is None:
                continue
            quota = previous.pop(tenant.name, None)
            if quota is None:
                quota = TenantQuota(tenant, self._clock)
            else:
                quota.configure(tenant)
            quotas[tenant.name] = quota
        self._quotas = quotas
        self._idle = {name: quota for name, quota in previous.items() if not quota.settled()}

    def get(self, name: str) -> TenantQuota | None:
        return self._quotas.get(name)

    def admit(self, tenant: Tenant, prompt_estimate: int) -> Refusal | None:
        quota = self._quotas.get(tenant.name)
        return None if quota is None else quota.admit(prompt_estimate)

    def charge(self, tenant: Tenant, tokens: float) -> None:
        quota = self._quotas.get(tenant.name)
        if quota is not None:
            quota.charge(tokens)

    def ratios(self) -> list[tuple[str, str, float]]:
        """(tenant, limit, level / capacity) of every bucket, for appliance_tenant_quota_remaining_ratio."""
        out: list[tuple[str, str, float]] = []
        for name in sorted(self._quotas):
            quota = self._quotas[name]
            for limit, bucket in ((TOKENS, quota.tokens), (REQUESTS, quota.requests)):
                if bucket is not None:
                    out.append((name, limit, bucket.level / bucket.capacity))
        return out


def estimate_prompt_tokens(prompt: str | None) -> int:
    """A prompt's tokens before the engine counts them: about four characters a token (English text with a BPE
    tokenizer); the engine's usage corrects it when the request ends."""
    if not prompt:
        return 1
    return max(1, math.ceil(len(prompt) / 4))
