"""The adaptive concurrency limit of each replica: AIMD on the replicas' own time to first token.

Each replica's limit grows by one request per limit's worth of requests that met the TTFT target (additive
increase) and shrinks by a factor when one misses it or fails (multiplicative decrease, at most once per
limit's worth of completions so one slow burst is one cut). Settings: ``admission.*``."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection


class AIMDLimit:
    """Additive-increase / multiplicative-decrease concurrency limit driven by per-request TTFT."""

    def __init__(self, initial: float, minimum: float, maximum: float, target_seconds: float,
                 decrease_factor: float = 0.9) -> None:
        self.value = float(min(max(initial, minimum), maximum))
        self.minimum = float(minimum)
        self.maximum = float(maximum)
        self.target_seconds = target_seconds
        self.decrease_factor = decrease_factor
        self._since_decrease = math.inf

    @property
    def limit(self) -> int:
        return max(int(self.minimum), int(self.value))

    def on_sample(self, ttft_seconds: float | None, *, failed: bool = False) -> None:
        self._since_decrease += 1
        if failed or (ttft_seconds is not None and ttft_seconds > self.target_seconds):
            if self._since_decrease >= self.value:  # one cut per limit's worth of completions
                self.value = max(self.minimum, self.value * self.decrease_factor)
                self._since_decrease = 0
        elif ttft_seconds is not None:
            self.value = min(self.maximum, self.value + 1.0 / self.value)


class ConcurrencyLimits:
    """One AIMD limit per replica, created on first use; unlimited when admission control is off."""

    UNLIMITED = 1 << 30

    def __init__(self, factory: Callable[[], AIMDLimit] | None) -> None:
        self._factory = factory
        self._limits: dict[str, AIMDLimit] = {}

    def limit_of(self, name: str) -> int:
        if self._factory is None:
            return self.UNLIMITED
        return self._get(name).limit

    def on_sample(self, name: str, ttft_seconds: float | None, *, failed: bool) -> None:
        if self._factory is not None:
            self._get(name).on_sample(ttft_seconds, failed=failed)

    def retain(self, names: Collection[str]) -> None:
        """Forget the limits of replicas not in ``names`` (gone from the fleet): one that comes back learns anew."""
        for name in [name for name in self._limits if name not in names]:
            del self._limits[name]

    def __len__(self) -> int:
        return len(self._limits)

    def _get(self, name: str) -> AIMDLimit:
        if name not in self._limits:
            assert self._factory is not None  # its callers ask only when admission control is on
            self._limits[name] = self._factory()
        return self._limits[name]
