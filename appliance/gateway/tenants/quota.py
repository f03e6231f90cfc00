"""Quotas: each tenant's ``tokens_per_minute`` and ``requests_per_minute`` as token buckets, and the reservation
each request holds in them while it runs.

A bucket holds one minute's worth (its capacity) and refills continuously at capacity / 60 per second. A request
reserves its worst case before it queues (``Quotas.reserve``): the tokens it may use at most (its prompt's
estimate plus ``max_tokens`` x ``n`` for every prompt: ``tenants.cost``) and one request per sequence it asks for
(prompts x ``n``). It is admitted only if both buckets hold that much now; one that could never fit (more than a
minute's worth) is refused for good (400), one that does not fit now waits (429 with ``Retry-After``: the whole
seconds until the buckets hold it). So a tenant can never have more work in flight than its quota, whatever its
clients do with their answers. When the request ends, its reservation is settled to what it used (``settle``):
the rest goes back, or, when the engine reported more than the worst case the gateway estimated (a prompt longer
than its estimate, a stream continued on another replica that prefilled it again), the difference is charged and
may put the bucket in debt, which the tenant's next request waits out. A request that never reached an engine is
refunded whole, its requests too (``refund``). Settling or refunding twice does nothing: a reservation is
settled once.

Levels survive a configuration reload (``Quotas.update``): a tenant in debt stays in debt, a new rate only changes
the capacity and the refill from now on, and a tenant (or a limit) removed and added back gets its bucket back as it
has refilled meanwhile, never a fresh full one. A reservation settles into the bucket it was taken from.
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
    """A request refused by a quota: which limit, the tenant's rate, and whole seconds until it can serve;
    ``needed``: what the request reserves of that limit; ``never``: more than the bucket can ever hold (waiting
    does not help: the request must ask for less)."""

    tenant: str
    limit: str  # TOKENS or REQUESTS
    per_minute: int
    retry_after: int
    needed: int = 1
    never: bool = False

    @property
    def message(self) -> str:
        what = "tokens" if self.limit == TOKENS else "requests"
        if self.never:
            asks = ("may use up to {} tokens (its prompt and max_tokens x n for each prompt; without max_tokens, the "
                    "model's context less the prompt)" if self.limit == TOKENS else "counts as {} requests (prompts "
                    "x n)").format(self.needed)
            fix = "lower max_tokens or n" if self.limit == TOKENS else "send fewer prompts or a lower n"
            return (f"this request {asks}, more than tenant {self.tenant}'s quota of {self.per_minute} {what} per "
                    f"minute can ever hold; {fix}")
        return (f"tenant {self.tenant} is over its quota of {self.per_minute} {what} per minute; retry in "
                f"{self.retry_after} s")


@dataclass(frozen=True)
class Cost:
    """What a request may use at most: its prompt tokens (estimated), its completion tokens (max_tokens x n per
    prompt), and the sequences it asks for (prompts x n), each counted by ``requests_per_minute``."""

    prompt: int
    completion: int
    requests: int = 1

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


class Reservation:
    """A request's hold on its tenant's buckets, from admission to its end: settled once, to what it used."""

    __slots__ = ("tokens", "requests", "_tokens_bucket", "_requests_bucket", "done")

    def __init__(self, tokens: float, requests: int, tokens_bucket: TokenBucket | None,
                 requests_bucket: TokenBucket | None) -> None:
        self.tokens = tokens if tokens_bucket is not None else 0.0  # what was taken
        self.requests = requests if requests_bucket is not None else 0
        self._tokens_bucket = tokens_bucket
        self._requests_bucket = requests_bucket
        self.done = False

    def settle(self, used: float) -> None:
        """The request is over and used ``used`` tokens: the rest of the reservation goes back, or the excess is
        charged (debt allowed). The requests taken stay taken. Only the first call counts."""
        if self.done:
            return
        self.done = True
        if self._tokens_bucket is not None:
            self._tokens_bucket.charge(max(0.0, used) - self.tokens)

    def refund(self) -> None:
        """The request never reached an engine: everything taken goes back. Only the first settle or refund
        counts."""
        if self.done:
            return
        self.settle(0)
        if self._requests_bucket is not None:
            self._requests_bucket.charge(-self.requests)


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

    def reserve(self, cost: Cost) -> Reservation | Refusal:
        """Both limits hold the request's worst case now: take it (a reservation). Else the first limit that does
        not: for good (``never``) when it exceeds the bucket's capacity, else until the bucket holds it."""
        for limit, bucket, needed in ((TOKENS, self.tokens, cost.tokens), (REQUESTS, self.requests, cost.requests)):
            if bucket is None:
                continue
            if needed > bucket.capacity:
                return Refusal(self.name, limit, int(bucket.capacity), 0, needed, never=True)
            if bucket.level < needed:
                return self._refusal(limit, bucket, needed)
        if self.tokens is not None:
            self.tokens.charge(cost.tokens)
        if self.requests is not None:
            self.requests.charge(cost.requests)
        return Reservation(cost.tokens, cost.requests, self.tokens, self.requests)

    def charge(self, tokens: float) -> None:
        if self.tokens is not None and tokens:
            self.tokens.charge(tokens)

    def _refusal(self, limit: str, bucket: TokenBucket, needed: float) -> Refusal:
        wait = max(1, math.ceil(bucket.seconds_until(needed)))
        return Refusal(self.name, limit, int(bucket.capacity), wait, math.ceil(needed))


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

    def reserve(self, tenant: Tenant, cost: Cost) -> Reservation | Refusal | None:
        """The tenant's reservation for a request of ``cost`` (None: the tenant has no quota), or its refusal."""
        quota = self._quotas.get(tenant.name)
        return None if quota is None else quota.reserve(cost)

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
