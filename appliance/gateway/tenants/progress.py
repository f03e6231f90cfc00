"""What streams show of their engines' progress, lent to the answers that show none.

A non-streaming answer comes in one piece at its end. When its client leaves, or the gateway times it out, the
engine aborts it as the connection closes and reports nothing, so how far it got is never seen; charging the
request's whole reservation then charges the tenant more than its engine did (on the demo engine, 1.6x for requests
timed out after 0.3-1.5 s). The streams the gateway relays do show their engine's progress: every leg's running
usage (the gateway asks for it) gives its replica's decode rate per sequence and how long its first token took.

``EngineProgress`` keeps both per replica, a moving average over the stream legs that ended lately, and estimates
what an unseen answer's engine made: its decode rate over the time the request spent there past the first token,
for each of its sequences. With no stream on that replica within ``RECENT_SECONDS`` there is no estimate, and the
caller charges the whole reservation. One per gateway process: a worker learns from the streams it relays.

The unseen answer's prompt is the gateway's own estimate too (``cost``: four characters a token, no tokenizer on
the path), which misses by the tenants' text and the model's tokenizer (on the demo engine, 2-4% fewer tokens
than the engine counted). Every answer whose usage came back shows how the engine counted a prompt the gateway
estimated, so the estimate is scaled by the engines' count over the gateway's estimate, both kept as moving sums
over the answers of the whole gateway (one model; a long prompt says more about the ratio than a short one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

RECENT_SECONDS = 60.0  # a replica's readings older than this say little of its load now: no estimate from them
WEIGHT = 0.2  # each new leg's share of a replica's average: a few legs move it, one odd leg does not
# Each answer's share of the prompts' moving sums: the tokens per character of a tenants' text change slowly, and
# one prompt's count is off by several percent either way (measured: +-10% on the demo engine), so about the
# last twenty answers make the ratio
PROMPT_WEIGHT = 0.05


@dataclass
class _Reading:
    rate: float  # completion tokens a second, per sequence
    first_token: float  # seconds from the leg's dispatch to its first token
    at: float  # monotonic: when the last leg was learned


class EngineProgress:
    """Per replica, the decode rate and time to first token of its recent stream legs."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._readings: dict[str, _Reading] = {}
        self._prompts: tuple[float, float] | None = None  # the moving sums: the gateway's estimates, engines' counts

    def learned(self, replica: str, rate: float, first_token: float) -> None:
        """A stream leg on ``replica`` ran at ``rate`` tokens a second per sequence, its first token
        ``first_token`` seconds after its dispatch. Replicas not heard from lately are forgotten (on Kubernetes
        every new pod is a new name)."""
        if rate <= 0 or first_token < 0:
            return
        now = self._clock()
        for name in [name for name, seen in self._readings.items() if now - seen.at > RECENT_SECONDS]:
            del self._readings[name]
        seen = self._readings.get(replica)
        if seen is None:
            self._readings[replica] = _Reading(rate, first_token, now)
            return
        seen.rate += WEIGHT * (rate - seen.rate)
        seen.first_token += WEIGHT * (first_token - seen.first_token)
        seen.at = now

    def completion(self, replica: str, sequences: int, seconds: float) -> int | None:
        """Completion tokens ``replica`` likely made for a request of ``sequences`` sequences in the ``seconds``
        since its dispatch: the replica's rate over the time past its first token; None without a recent reading."""
        seen = self._readings.get(replica)
        if seen is None or self._clock() - seen.at > RECENT_SECONDS:
            return None
        return round(seen.rate * max(0.0, seconds - seen.first_token) * max(1, sequences))

    def prompt_counted(self, estimated: int, counted: int) -> None:
        """An engine counted ``counted`` tokens for a prompt the gateway estimated at ``estimated``."""
        if estimated <= 0 or counted <= 0:
            return
        if self._prompts is None:
            self._prompts = (float(estimated), float(counted))
            return
        before, engine = self._prompts
        self._prompts = (before + PROMPT_WEIGHT * (estimated - before), engine + PROMPT_WEIGHT * (counted - engine))

    def prompt(self, estimated: int) -> int:
        """The tokens an engine likely counted for a prompt the gateway estimated at ``estimated`` (as it is
        before any answer came back)."""
        if self._prompts is None:
            return estimated
        before, engine = self._prompts
        return max(1, round(estimated * engine / before))
