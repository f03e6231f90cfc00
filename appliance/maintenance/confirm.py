"""Alerts confirm, never command: an alert's action runs only while the appliance's own detectors agree.

Alertmanager accepts alerts from anyone who reaches it (any local user, any container on the compose network),
so an alert is a claim, not an order. For each whitelisted action the appliance has its own view of what the
alert is about, the same view that makes the alert fire in the first place:
- ``restart`` (one replica, ApplianceReplicaHung): that replica is hung by the progress monitor (running
  requests, no generated token for ``hung_after_seconds``);
- ``rolling_restart`` (ApplianceFragmentationRising): the memory watch's latest reading shows a replica (the
  alert's, when it names one of ours) whose fragmentation exceeds ``alert_confirm_fragmentation_ratio`` (the
  alert rule's own threshold), or that is over the watch's own thresholds (fragmentation or growth).
Without a reading of its own (collectors disabled) nothing is confirmed: unknown is not agreement.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.maintenance.memory import MemoryWatch


class AlertConfirmation:
    def __init__(self, is_hung: Callable[[str], bool], memory: MemoryWatch | None, *,
                 fragmentation_ratio: float) -> None:
        self._is_hung = is_hung
        self._memory = memory
        self.fragmentation_ratio = fragmentation_ratio

    def disagreement(self, action: str, replica: str | None) -> str | None:
        """None when the appliance's own view agrees that ``action`` is due (on ``replica``, or on any replica
        when None); otherwise what its own view says instead, for the record."""
        if action == "restart":
            if replica is not None and self._is_hung(replica):
                return None
            return f"{replica} makes progress by the appliance's own view (not hung)"
        return self._memory_disagreement(replica)

    def _memory_disagreement(self, replica: str | None) -> str | None:
        if self._memory is None:
            return "the appliance has no memory reading of its own (collectors disabled)"
        readings = self._memory.readings
        if readings is None:
            return "the appliance has no memory reading of its own yet"
        names = [replica] if replica is not None else sorted(readings)
        seen = []
        for name in names:
            if name in self._memory.over:
                return None
            ratio = readings[name].fragmentation_ratio if name in readings else None
            if ratio is not None and ratio > self.fragmentation_ratio:
                return None
            seen.append(f"{name} fragmentation {ratio:.2f}" if ratio is not None else f"{name} no fragmentation "
                        "reading")
        return (f"own reading: {', '.join(seen) or 'no replica'} (confirms above "
                f"{self.fragmentation_ratio:.2f}, or over the memory watch's thresholds)")
