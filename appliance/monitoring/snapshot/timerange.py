"""The time range of a snapshot, from what people type (``now-1h``, ``-30m``, ISO 8601), resolved the way Grafana
would resolve it (step, ``$__rate_interval``), and the error type of every problem a user can fix."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

MAX_POINTS = 11_000  # Prometheus refuses range queries with more points per series
DEFAULT_POINTS = 240  # default resolution: about one point per 2 px of a panel image


class SnapshotError(Exception):
    """A problem the user can fix (exit 2); raised before anything is written."""


# --- time range --------------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90s``, ``5m``, ``1h30m``, or plain seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise SnapshotError(f"bad duration {text!r} (e.g. 30s, 5m, 1h30m)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_time(text: str, now: float) -> float:
    """``now``, ``now-1h``, ``-1h`` (relative to now), Unix seconds, or ISO 8601 (UTC unless it says)."""
    text = text.strip()
    if text == "now":
        return now
    relative = re.fullmatch(r"(?:now)?\s*([-+])\s*(\S+)", text)
    if relative and not re.fullmatch(r"[-+]?\d+(?:\.\d+)?", text):
        sign = -1 if relative.group(1) == "-" else 1
        return now + sign * parse_duration(relative.group(2))
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SnapshotError(f"bad time {text!r} (now, now-1h, -30m, Unix seconds or ISO 8601)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@dataclass(frozen=True)
class TimeRange:
    start: float
    end: float
    step: float
    rate_interval: str

    @classmethod
    def resolve(cls, start: str, end: str, *, step: str | None, rate_interval: str | None,
                scrape_interval: float, now: float) -> TimeRange:
        """Grafana's rules: ``$__rate_interval`` = max(step + scrape interval, 4 x scrape interval)."""
        first, last = parse_time(start, now), parse_time(end, now)
        if not first < last:
            raise SnapshotError(f"empty time range: --from {start} is not before --to {end}")
        span = last - first
        resolution = parse_duration(step) if step else max(scrape_interval, math.ceil(span / DEFAULT_POINTS))
        if resolution <= 0:
            raise SnapshotError("--step must be positive")
        if span / resolution > MAX_POINTS:
            raise SnapshotError(f"--step {resolution:g}s gives {span / resolution:.0f} points per series; "
                                f"Prometheus allows {MAX_POINTS}: use a larger step")
        if rate_interval:
            parse_duration(rate_interval)
            window = rate_interval
        else:
            window = f"{math.ceil(max(resolution + scrape_interval, 4 * scrape_interval))}s"
        return cls(first, last, resolution, window)
