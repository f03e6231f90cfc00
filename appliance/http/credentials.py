"""The bearer credentials the appliance accepts, by role: the one value the auth checks read
(``appliance.http.auth``), built from the live settings (``Settings.credentials``), so a reload that changes the
keys is seen by the next request.

A reload that rotates a secret (``appliance reload``) keeps the value it replaces valid for an overlap window
(``gateway.secret_overlap_seconds``), so that the clients holding it (Prometheus, Alertmanager, operators' shells,
node pods, API clients) can move to the new one without a refused request in between; after the window it is
refused. The :class:`Keyring` holds the live credentials with those earlier values and their deadlines."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

# The roles a credential is accepted in, as Credentials names its fields.
API_KEYS, ADMIN, ALERTS, METRICS, LEASE = "api_keys", "admin_token", "alerts_token", "metrics_token", "lease_token"
ROLES = (API_KEYS, ADMIN, ALERTS, METRICS, LEASE)

Clock = Callable[[], float]


def digest(secret: str) -> bytes:
    """A fixed-length stand-in for a secret: comparing digests in constant time reveals neither a near miss nor
    the secret's length."""
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class Retired:
    """An earlier value of a role's secret, still accepted until ``until`` (monotonic)."""

    role: str
    value: str
    until: float


@dataclass(frozen=True)
class Credentials:
    api_keys: tuple[str, ...] = ()  # /v1: the gateway's keys and every tenant's; empty: the API is open
    admin_token: str | None = None  # /admin, and whatever a narrower credential opens
    alerts_token: str | None = None  # /admin/alerts only (Alertmanager's webhook)
    metrics_token: str | None = None  # /metrics and /sd/targets (or the admin token)
    lease_token: str | None = None  # a node pod's restart lease only (or the admin token)
    retired: tuple[Retired, ...] = ()  # earlier values still inside their overlap window (Keyring)
    _digests: dict[str, tuple[bytes, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def current(self, role: str) -> tuple[str, ...]:
        """The role's values as configured now (without earlier ones)."""
        value = getattr(self, role)
        if role == API_KEYS:
            return tuple(value)
        return (value,) if value else ()

    def accepted(self, role: str) -> tuple[bytes, ...]:
        """Digests of every value the role accepts: the configured ones and those still in their overlap window.
        Computed once per Credentials (a reload builds new ones)."""
        found = self._digests.get(role)
        if found is None:
            values = [*self.current(role), *(r.value for r in self.retired if r.role == role)]
            found = self._digests[role] = tuple(digest(value) for value in values)
        return found

    def enabled(self, role: str) -> bool:
        """Whether the role accepts any value at all (a removed token stays enabled through its window)."""
        return bool(self.accepted(role))


class Keyring:
    """The live credentials and the earlier values a reload replaced, each accepted until its overlap window ends.

    ``rotate`` takes the reloaded credentials: every value the role accepted before and does not accept now is
    kept for ``overlap_seconds`` (0: refused at once), unless ``keep`` says otherwise (an API key whose tenant was
    removed is revoked, not rotated). An earlier value keeps its first deadline through later reloads: a second
    rotation does not extend the first one's window, and a shorter overlap shortens it (0 ends every window: the
    way to drop a leaked value at once). ``current`` drops values whose window has ended."""

    def __init__(self, credentials: Credentials, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._credentials = credentials

    def current(self) -> Credentials:
        """The credentials to check a request against now."""
        credentials = self._credentials
        if credentials.retired and min(r.until for r in credentials.retired) <= self._clock():
            credentials = self._credentials = self._without_expired(credentials)
        return credentials

    def rotate(self, new: Credentials, overlap_seconds: float,
               keep: Callable[[str, str], bool] = lambda _role, _value: True) -> list[Retired]:
        """Make ``new`` the live credentials; returns what stays accepted for a while besides them."""
        old, now = self.current(), self._clock()
        retired = [replace(r, until=min(r.until, now + overlap_seconds)) for r in self._carried(old, new, keep)]
        retired = [r for r in retired if r.until > now]
        if overlap_seconds > 0:
            carried = {(r.role, r.value) for r in retired}
            for role in ROLES:
                still = set(new.current(role))
                retired += [Retired(role, value, now + overlap_seconds) for value in old.current(role)
                            if value not in still and (role, value) not in carried and keep(role, value)]
        self._credentials = replace(new, retired=tuple(retired))
        return retired

    @staticmethod
    def _carried(old: Credentials, new: Credentials, keep: Callable[[str, str], bool]) -> Iterable[Retired]:
        """Earlier values from an earlier rotation, still in their window and not configured again."""
        for entry in old.retired:
            if entry.value not in new.current(entry.role) and keep(entry.role, entry.value):
                yield entry

    def _without_expired(self, credentials: Credentials) -> Credentials:
        now = self._clock()
        return replace(credentials, retired=tuple(r for r in credentials.retired if r.until > now))
