"""Each engine's ``system_fingerprint``, remembered, so that a stream whose usage event the gateway hides need not
wait for that event to write the client's finishing chunks.

vLLM builds its fingerprint once, when its server starts (``--fingerprint-mode``: by default its version and a hash
of its configuration; a literal; or none at all), and writes that one value on every answer of the server: on a
stream's finishing chunks when no usage event follows, on the usage event instead when one does. The gateway asks
every stream for the usage event (``usage.usage_options``), so it reads each engine's fingerprint at the end of the
first stream it relays from it; from then on the finishing chunks of that engine's streams get it as they come
(``usage.HiddenUsage``) instead of waiting, with everything the other choices send after them, for the usage event.

An engine is known by its replica's name, URL and start count: one the appliance restarts (perhaps on a new
configuration, after a reload) is unknown again until it reports. An engine someone else runs can be reconfigured
behind the same name and URL unseen: every usage event is compared with what is remembered, and the memory
follows it (the streams relayed meanwhile wrote the old value). One entry per replica name, and names that left the
fleet are dropped when a new one comes, so the memory is the size of the fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from appliance.engine.contract import Replica

log = logging.getLogger(__name__)

EngineKey = tuple[str, str, int]  # replica name, URL, start count


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What an engine writes as ``system_fingerprint``; ``value`` None when it writes none (``--fingerprint-mode
    none``: the finishing chunks then carry no such key)."""

    value: str | None

    @classmethod
    def of(cls, event: dict[str, Any]) -> Fingerprint:
        """The fingerprint a parsed usage event carries."""
        value = event.get("system_fingerprint")
        return cls(value if isinstance(value, str) else None)


def engine_key(replica: Replica) -> EngineKey:
    return replica.name, replica.url, replica.status.starts


class Fingerprints:
    """The last fingerprint each engine reported. ``fleet``: the names of the replicas routed to now."""

    def __init__(self, fleet: Callable[[], Iterable[str]] = tuple) -> None:
        self.fleet = fleet
        self._known: dict[str, tuple[EngineKey, Fingerprint]] = {}
        self.changed = 0  # reports that differed from the fingerprint remembered for the same engine

    def known(self, key: EngineKey) -> Fingerprint | None:
        """The engine's fingerprint; None until it has reported one."""
        entry = self._known.get(key[0])
        return entry[1] if entry is not None and entry[0] == key else None

    def learn(self, key: EngineKey, fingerprint: Fingerprint) -> None:
        """A usage event from the engine: what it wrote is what it writes."""
        entry = self._known.get(key[0])
        if entry is None:
            self._forget_departed()
        elif entry[0] == key and entry[1] != fingerprint:
            self.changed += 1
            log.warning("%s's system_fingerprint changed from %s to %s without a restart the gateway saw",
                        key[0], entry[1].value, fingerprint.value)
        self._known[key[0]] = (key, fingerprint)

    def _forget_departed(self) -> None:
        present = set(self.fleet())
        for name in [name for name in self._known if name not in present]:
            del self._known[name]
