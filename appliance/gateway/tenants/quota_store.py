"""One quota across gateways: each tenant's two token buckets kept in Redis, shared by every gateway that points at
it, so that G gateway pods hold a tenant to its quota, not to G times it.

The arithmetic is ``tenants.quota``'s, run inside Redis as one Lua script (``BUCKET_SCRIPT``, registered once and
called by EVALSHA), so a reservation checks and takes both buckets of a tenant atomically, whichever gateway asks:
a request that could never fit is refused for good (``Refusal.never``: 400), one that does not fit now waits (429,
``Retry-After``: the whole seconds until the buckets hold it, at least 1), a settle charges the difference to what
was used (debt allowed, never above capacity), a refund gives back everything taken, and a reservation settles
once. Levels refill by the store's clock (Redis ``TIME``), not the gateways', so gateways whose clocks differ
agree on every level.

Rates are not stored: each call carries the calling gateway's own rates (a reload applies at its next call), and
the bucket's level is kept across a change of rate, clamped to the new capacity. A key holds one tenant's buckets
(``<key_prefix>:<tenant>``) and expires once both would have refilled (plus ``KEY_SLACK_SECONDS``): an idle
tenant's key goes, and a fresh full bucket is what it would have been anyway, so nothing leaks and nothing is
forgiven. A limit a reload unset keeps its stored level (and the key its expiry) until it is set again.

A reservation is settled off the response path: ``settle``, ``refund`` and ``charge`` start a tracked task (its
failure counted, the tasks drained at shutdown), so a request's answer never waits for the store. What the store
did not get because it was known to be down (the settles of those minutes, and the whole use of the requests
admitted unchecked under ``failure: open``) is owed, one sum per tenant (``appliance_quota_store_owed_tokens``),
and written when it answers again, so an outage does not forgive what was used in it. A call that timed out may
have been applied all the same (Redis runs what it received once it can), so it is counted and not repeated: it
never counts twice, and an outage loses at most the one call per gateway that found the store gone.

The store can be unreachable; each call has ``timeout_seconds``. Then ``reserve`` raises ``StoreUnavailable`` and
the caller fails in the configured direction (``tenants.metering``); ``reachable`` says so, the state changes are
logged once each way (``appliance_quota_store_up``), every failed call is counted by operation
(``appliance_quota_store_errors_total``), and while the store is down one call a ``probe_seconds`` tries it again
while the others fail at once, so a store that does not answer does not add its timeout to every request. A PING
every ``probe_seconds`` (``start``) keeps that state true while no request comes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import LIMITS, REQUESTS, TOKENS, Cost, Refusal
from appliance.gateway.tenants.settings import QuotaStoreSettings

log = logging.getLogger(__name__)

KEY_SLACK_SECONDS = 60  # a key outlives the moment both its buckets are full by this much
OPERATIONS = ("reserve", "settle", "charge", "ping")  # appliance_quota_store_errors_total's ``operation``
DIRECTIONS = ("open", "closed")  # appliance_quota_store_unchecked_requests_total's ``direction``

# KEYS[1]: the tenant's hash (tl, ta: the tokens bucket's level and when; rl, ra: the requests bucket's).
# ARGV: op (reserve | charge), now ('' : the store's TIME), then tokens capacity, tokens amount, requests capacity,
# requests amount; a capacity of 0: that limit is not set (its bucket is neither read nor written).
# reserve: {'ok', tokens level, requests level} | {'never', limit} | {'wait', limit, seconds}; charge: {'ok', ...}.
# Levels go back as strings: Redis turns a Lua number into an integer.
BUCKET_SCRIPT = """
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[2])
end
local fields = {{'tl', 'ta'}, {'rl', 'ra'}}
local caps = {tonumber(ARGV[3]), tonumber(ARGV[5])}
local amounts = {tonumber(ARGV[4]), tonumber(ARGV[6])}
local stored = redis.call('HMGET', KEYS[1], 'tl', 'ta', 'rl', 'ra')
local levels, ats = {}, {}
for i = 1, 2 do
  local cap = caps[i]
  if cap > 0 then
    local level, at = tonumber(stored[2 * i - 1]), tonumber(stored[2 * i])
    if level == nil or at == nil then
      level, at = cap, now
    end
    if now > at then
      level = level + (now - at) * cap / 60
      at = now
    end
    levels[i], ats[i] = math.min(cap, level), at
  end
end
if ARGV[1] == 'reserve' then
  for i = 1, 2 do
    local cap, needed = caps[i], amounts[i]
    if cap > 0 then
      if needed > cap then
        return {'never', i}
      end
      if levels[i] < needed then
        return {'wait', i, tostring((needed - levels[i]) / (cap / 60))}
      end
    end
  end
end
local ttl = 0
local untouched = false
for i = 1, 2 do
  local cap = caps[i]
  if cap > 0 then
    levels[i] = math.min(cap, levels[i] - amounts[i])
    redis.call('HSET', KEYS[1], fields[i][1], tostring(levels[i]), fields[i][2], tostring(ats[i]))
    ttl = math.max(ttl, (cap - levels[i]) / (cap / 60))
  elseif stored[2 * i - 1] then
    untouched = true
  end
end
ttl = math.ceil(ttl) + tonumber(ARGV[7])
if untouched then
  ttl = math.max(ttl, redis.call('TTL', KEYS[1]))
end
redis.call('EXPIRE', KEYS[1], ttl)
return {'ok', tostring(levels[1] or ''), tostring(levels[2] or '')}
"""


class StoreUnavailable(Exception):
    """The quota store did not answer in time, refused the connection, or answered with an error. ``unsent``: the
    call never left the gateway (the store was known to be down), so it certainly did nothing; otherwise it may
    have been applied (a timeout says nothing of what the store did with the call)."""

    def __init__(self, message: str, *, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent


class SharedReservation:
    """A request's hold on its tenant's shared buckets (``quota.Reservation``'s contract): settled once, off the
    response path. The capacities are the ones it was reserved under, so it settles into the buckets it took
    from."""

    __slots__ = ("store", "tenant", "tokens", "requests", "caps", "done", "owed_requests")

    def __init__(self, store: SharedQuotas, tenant: str, tokens: int, requests: int,
                 caps: tuple[int, int], *, owed_requests: int = 0) -> None:
        """``owed_requests``: requests counted only when the request is settled (an unchecked admission took
        nothing, so what it used is charged at its end, requests included)."""
        self.store = store
        self.tenant = tenant
        self.tokens = tokens if caps[0] else 0  # what was taken
        self.requests = requests if caps[1] else 0
        self.caps = caps
        self.done = False
        self.owed_requests = owed_requests if caps[1] else 0

    def settle(self, used: float) -> None:
        """The request is over and used ``used`` tokens: the rest goes back, or the excess is charged (debt
        allowed). The requests taken stay taken. Only the first call counts."""
        if self.done:
            return
        self.done = True
        amount = max(0.0, used) - self.tokens if self.caps[0] else 0.0
        if amount or self.owed_requests:
            self.store.background("settle", self.tenant, self.caps, amount, self.owed_requests)

    def refund(self) -> None:
        """The request never reached an engine: everything taken goes back. Only the first settle or refund
        counts."""
        if self.done:
            return
        self.done = True
        if self.tokens or self.requests:
            self.store.background("settle", self.tenant, self.caps, -self.tokens, -self.requests)


def limits_of(tenant: Tenant) -> tuple[int, int]:
    """The tenant's capacities as the script takes them (0: the limit is not set)."""
    return tenant.tokens_per_minute or 0, tenant.requests_per_minute or 0


class SharedQuotas:
    """Every tenant's buckets in one Redis, shared by the gateways that point at it; tenants without a quota cost
    no round trip. ``clock``: the time the script refills by (tests run it fast); None: the store's own."""

    def __init__(self, client: Redis, settings: QuotaStoreSettings, registry: CollectorRegistry | None = None,
                 *, clock: Callable[[], float] | None = None) -> None:
        self.client = client
        self.settings = settings
        self.clock = clock
        self._script = client.register_script(BUCKET_SCRIPT)
        self.reachable = True
        self._down_since: float | None = None
        self._probe_at = 0.0  # while down: when the next call may try the store again
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None
        self._levels: dict[tuple[str, str], float] = {}  # (tenant, limit): level / capacity, as last seen
        self.up = Gauge("appliance_quota_store_up", "1 while the shared quota store (Redis) answers the gateway, 0 "
                        "while it does not (requests then fail open or closed as quota_store.failure says).",
                        registry=registry)
        self.up.set(1)
        self.errors = Counter("appliance_quota_store_errors", "Calls to the shared quota store that failed "
                              "(unreachable, timed out, an error), by operation: reserve (a request's admission), "
                              "settle (a reservation settled or refunded), charge, ping (the periodic check).",
                              ["operation"], registry=registry)
        self.unchecked = Counter("appliance_quota_store_unchecked_requests", "Requests whose quota could not be "
                                 "checked because the store failed, by direction: open (admitted without quota), "
                                 "closed (refused 503).", ["direction"], registry=registry)
        self._owed: dict[str, tuple[float, int, tuple[int, int]]] = {}  # tenant -> tokens, requests, caps
        self.owed = Gauge("appliance_quota_store_owed_tokens", "Tokens this gateway charged to tenants while the "
                          "shared quota store did not answer (requests admitted unchecked, settles that failed), "
                          "written to the store once it answers again.", registry=registry)
        self.owed.set_function(lambda: sum(tokens for tokens, _requests, _caps in self._owed.values()))
        for operation in OPERATIONS:
            self.errors.labels(operation)
        for direction in DIRECTIONS:
            self.unchecked.labels(direction)

    @property
    def fails_open(self) -> bool:
        return self.settings.failure == "open"

    @property
    def retry_after_seconds(self) -> int:
        return self.settings.retry_after_seconds

    def count_unchecked(self, direction: str) -> None:
        self.unchecked.labels(direction).inc()

    def key(self, tenant: str) -> str:
        return f"{self.settings.key_prefix}:{tenant}"

    # -- calls ----------------------------------------------------------------------------------------------------

    async def reserve(self, tenant: Tenant, cost: Cost) -> SharedReservation | Refusal | None:
        """The tenant's reservation for a request of ``cost`` (None: the tenant has no quota), or its refusal;
        raises ``StoreUnavailable`` when the store cannot say."""
        caps = limits_of(tenant)
        if not any(caps):
            return None
        reply = await self._call("reserve", "reserve", tenant.name, caps, cost.tokens, cost.requests)
        verdict = reply[0]
        if verdict == "ok":
            self._seen(tenant.name, caps, reply)
            return SharedReservation(self, tenant.name, cost.tokens, cost.requests, caps)
        index = int(reply[1]) - 1
        limit, needed = LIMITS[index], (cost.tokens, cost.requests)[index]
        if verdict == "never":
            return Refusal(tenant.name, limit, caps[index], 0, needed, never=True)
        wait = max(1, math.ceil(float(reply[2])))
        return Refusal(tenant.name, limit, caps[index], wait, math.ceil(needed))

    def admit_unchecked(self, tenant: Tenant, cost: Cost) -> SharedReservation:
        """A request admitted while the store could not be asked (``failure: open``): nothing was taken, so its
        settle charges all it used and its requests; while the store is still down, that is owed (``_owe``)."""
        return SharedReservation(self, tenant.name, 0, 0, limits_of(tenant), owed_requests=cost.requests)

    def charge(self, tenant: Tenant, tokens: float) -> None:
        """Charge ``tokens`` to the tenant's tokens bucket (debt allowed), off the caller's path."""
        caps = limits_of(tenant)
        if caps[0] and tokens:
            self.background("charge", tenant.name, (caps[0], 0), tokens, 0)

    async def levels(self, tenant: Tenant) -> dict[str, float]:
        """The tenant's levels now, by limit (a charge of nothing: refilled to the store's clock)."""
        caps = limits_of(tenant)
        reply = await self._call("charge", "charge", tenant.name, caps, 0, 0)
        self._seen(tenant.name, caps, reply)
        return {limit: float(reply[index + 1]) for index, limit in enumerate(LIMITS) if caps[index]}

    def background(self, operation: str, tenant: str, caps: tuple[int, int], tokens: float, requests: int) -> None:
        """A charge (positive) or a return (negative) as a tracked task: failures counted, drained at close."""
        task = asyncio.get_running_loop().create_task(self._charge(operation, tenant, caps, tokens, requests))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _charge(self, operation: str, tenant: str, caps: tuple[int, int], tokens: float,
                      requests: int) -> None:
        try:
            reply = await self._call(operation, "charge", tenant, caps, tokens, requests)
        except StoreUnavailable as exc:
            if exc.unsent:  # certainly not applied: written once the store answers again
                self._owe(tenant, caps, tokens, requests)
            return  # counted; one that may have been applied is not repeated (it would count twice)
        self._seen(tenant, caps, reply)

    def _owe(self, tenant: str, caps: tuple[int, int], tokens: float, requests: int) -> None:
        """A charge or a return the store did not take, kept as one sum per tenant (bounded by the tenants, not
        by the requests) until it answers again; the last capacities it was made under are the ones it pays into."""
        owed_tokens, owed_requests, _caps = self._owed.get(tenant, (0.0, 0, caps))
        self._owed[tenant] = (owed_tokens + tokens, owed_requests + requests, caps)

    def _pay_owed(self) -> None:
        """What was owed while the store was down, written now that it answers (a failure owes it again)."""
        owed, self._owed = self._owed, {}
        for tenant, (tokens, requests, caps) in owed.items():
            if tokens or requests:
                self.background("charge", tenant, caps, tokens, requests)

    async def _call(self, operation: str, op: str, tenant: str, caps: tuple[int, int], tokens: float,
                    requests: float) -> list[str]:
        if not self.reachable and time.monotonic() < self._probe_at:
            self.errors.labels(operation).inc()
            raise StoreUnavailable("the quota store is unreachable", unsent=True)
        now = "" if self.clock is None else repr(self.clock())
        args: list[str | int | float] = [op, now, caps[0], repr(float(tokens)), caps[1], requests, KEY_SLACK_SECONDS]
        try:
            async with asyncio.timeout(self.settings.timeout_seconds):
                reply = await self._script(keys=[self.key(tenant)], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(operation, exc)
            raise StoreUnavailable(f"the quota store failed: {type(exc).__name__}") from exc
        self._answered()
        return [item.decode() if isinstance(item, bytes) else str(item) for item in reply]

    # -- state ----------------------------------------------------------------------------------------------------

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.errors.labels(operation).inc()
        self._probe_at = time.monotonic() + self.settings.probe_seconds
        if self.reachable:
            self.reachable = False
            self._down_since = time.time()
            self.up.set(0)
            log.error("quota store %s unreachable (%s: %s): requests now fail %s (quota_store.failure)",
                      self.settings.redacted_url, type(exc).__name__, exc or "timed out", self.settings.failure)

    def _answered(self) -> None:
        if not self.reachable:
            self.reachable = True
            down = time.time() - (self._down_since or time.time())
            self._down_since = None
            self.up.set(1)
            log.warning("quota store %s reachable again after %.1f s: quotas are checked again%s",
                        self.settings.redacted_url, down,
                        f"; {len(self._owed)} tenant(s)' charges made meanwhile are written now" if self._owed
                        else "")
            self._pay_owed()

    def _seen(self, tenant: str, caps: tuple[int, int], reply: list[str]) -> None:
        for index, limit in enumerate(LIMITS):
            if caps[index] and reply[index + 1]:
                self._levels[(tenant, limit)] = float(reply[index + 1]) / caps[index]

    def ratios(self, tenants: Iterable[Tenant]) -> list[tuple[str, str, float]]:
        """(tenant, limit, level / capacity) as this gateway last saw each bucket (1.0 before it saw one), for
        appliance_tenant_quota_remaining_ratio."""
        out: list[tuple[str, str, float]] = []
        for tenant in sorted(tenants, key=lambda t: t.name):
            for limit, cap in zip((TOKENS, REQUESTS), limits_of(tenant), strict=True):
                if cap:
                    out.append((tenant.name, limit, self._levels.get((tenant.name, limit), 1.0)))
        return out

    def start(self) -> None:
        """The periodic PING (in the running loop): the store's state stays true while no request comes."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watching())

    async def _watching(self) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_seconds)
            try:
                async with asyncio.timeout(self.settings.timeout_seconds):
                    await cast(Awaitable[bool], self.client.ping())  # redis.asyncio's: typed for both clients
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("ping", exc)
            else:
                self._answered()

    def state(self) -> dict[str, Any]:
        """For the gateway's health and status JSON."""
        return {"kind": "redis", "reachable": self.reachable, "failure": self.settings.failure,
                "down_since": self._down_since}

    async def drain(self, timeout_seconds: float) -> int:
        """Wait up to ``timeout_seconds`` for the settles in flight; returns how many did not finish (cancelled)."""
        pending = set(self._tasks)
        if pending:
            _done, pending = await asyncio.wait(pending, timeout=timeout_seconds)
            for task in pending:
                task.cancel()
        return len(pending)

    async def close(self, timeout_seconds: float = 2.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        left = await self.drain(timeout_seconds)
        if left:
            log.warning("quota store: %d settle(s) still in flight at shutdown were dropped", left)
        await self.client.aclose()


def connect(settings: QuotaStoreSettings) -> Redis:
    """The client: one pool, the per-call timeout on connect and read, and no retries of its own (a failed call
    fails in the configured direction at once; the next request tries again)."""
    return Redis.from_url(settings.url, password=settings.password, socket_timeout=settings.timeout_seconds,
                          socket_connect_timeout=settings.timeout_seconds, retry=Retry(NoBackoff(), 0),
                          health_check_interval=0)

