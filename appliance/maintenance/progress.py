"""Forward-progress liveness: a replica with running requests whose generated-token counter stands still.

vLLM's /health can stay green while its engine core is stuck (a wedged collective, a kernel that never returns):
the API server answers, nothing is generated. The gateway already reads each engine's running-request gauge and
generation-token counter every second (``EngineLoadPoller``); a replica that has requests running but whose
counter has not moved for ``hung_after_seconds`` is hung. Readings older than the hung period say nothing and
are ignored; a replica with nothing running is never hung.

The engine's own gauges are not trusted alone: on a loaded host vLLM's running gauge can read 0 while a request
runs, and its counters can lag. The gateway knows first-hand what it sent (its in-flight count: a replica with
requests in flight is busy whatever the gauge says) and what came back (bytes relayed from the replica since the
last check are progress whatever the counter says).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from appliance.engine.load import EngineLoad

log = logging.getLogger(__name__)


@dataclass
class _Progress:
    tokens: float | None = None
    progressed_at: float = 0.0
    hung: bool = False


class ProgressMonitor:
    def __init__(self, replica_names: Callable[[], Sequence[str]], loads: Callable[[], Mapping[str, EngineLoad]], *,
                 hung_after_seconds: float, in_flight: Callable[[str], int] = lambda _name: 0,
                 relayed_at: Callable[[str], float | None] = lambda _name: None) -> None:
        self._names = replica_names
        self._loads = loads
        self._in_flight = in_flight
        self._relayed_at = relayed_at
        self.hung_after_seconds = hung_after_seconds
        self._state: dict[str, _Progress] = {}

    def check(self, now: float) -> list[str]:
        """Update every replica's verdict from the latest engine readings (``now`` on the readings' clock,
        i.e. monotonic); return the hung replicas."""
        loads = self._loads()
        names = list(self._names())
        for gone in set(self._state) - set(names):
            del self._state[gone]
        for name in names:
            state = self._state.setdefault(name, _Progress(progressed_at=now))
            load = loads.get(name)
            if load is None or now - load.read_at > self.hung_after_seconds:
                self._set(name, state, False)  # no recent reading: unknown, which is not hung
                state.tokens, state.progressed_at = None, now
                continue
            tokens = load.generation_tokens_total
            busy = bool(load.running) or self._in_flight(name) > 0
            relayed = self._relayed_at(name)
            counter_standing = tokens is not None and state.tokens is not None and tokens == state.tokens
            if not busy or not counter_standing or (relayed is not None and relayed > state.progressed_at):
                state.progressed_at = now
            state.tokens = tokens
            self._set(name, state, now - state.progressed_at >= self.hung_after_seconds)
        return self.hung()

    def hung(self) -> list[str]:
        return sorted(name for name, state in self._state.items() if state.hung)

    def is_hung(self, name: str) -> bool:
        state = self._state.get(name)
        return bool(state and state.hung)

    def names(self) -> list[str]:
        return sorted(self._state)

    @staticmethod
    def _set(name: str, state: _Progress, hung: bool) -> None:
        if hung and not state.hung:
            log.error("%s is hung: requests running but no token generated for a while", name)
        elif state.hung and not hung:
            log.info("%s makes progress again", name)
        state.hung = hung
