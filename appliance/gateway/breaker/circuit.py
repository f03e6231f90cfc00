"""The circuit breakers, one per request shape that failed: what the gateway remembers of inputs that make engines
fail, and when it blames the input rather than the engine.

A shape's failures are error answers of an engine's own (a 500, a 5xx error event; ``Outcome.SERVER_ERROR``),
remembered per replica for ``window_seconds``. The input is at fault once the shape failed on ``replicas``
distinct replicas that are otherwise healthy: each served a request in full within ``window_seconds``, or served
one before and failed no request of another shape since (an idle replica is healthy; one that never served is not
known to work). Then its breaker opens: the
shape is refused for ``cooldown_seconds``, and its failures on healthy replicas are never the engines' (they do
not count toward ejection). The health condition keeps an outage from being blamed on its victims: once the
engines have failed everything for a window, none is healthy, no input is at fault and every failure counts, as
before. Within that window a shape that fails on two replicas is refused (422 rather than the engines' 500) and
not counted: an outage of every replica ends in the panic threshold anyway, where ejection routes nothing away.
An engine whose different requests fail is ejected as before, at once: each of its failed requests succeeds on
another replica, so no one shape fails twice.

Past the cooldown the breaker is half-open: one request of the shape goes through as a trial (the others are
refused while it runs); its failure opens the breaker again at once, its success forgets the shape. A shape that
succeeds anywhere before its breaker opened is forgotten too: its failures were the engines'.

Memory is bounded: only shapes that failed are kept, in an LRU of at most ``max_shapes`` (about 450 bytes each);
a shape neither open nor failed within the window is dropped when met. The engines' service times are kept per
replica name, with its last two failures of distinct shapes (a few, bounded the same way). Every method is O(1)
but ``open_count`` (at scrape time).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.gateway.breaker.settings import BreakerSettings

MAX_REPLICAS_REMEMBERED = 4096  # replica names whose last service time is kept (a fleet is far smaller)


@dataclass(slots=True)
class ShapeRecord:
    """What is known of one shape: where it failed, and its breaker's state."""

    failed: dict[str, float] = field(default_factory=dict)  # replica -> monotonic time of its last failure there
    opened_until: float | None = None  # None: closed (watching); else refused until then, half-open after
    trial: bool = False  # half-open: a request is being let through as the trial
    touched: float = 0.0  # monotonic: the last failure, refusal or trial


@dataclass(frozen=True, slots=True)
class Admission:
    """The breaker's answer to a request of a shape: refused (for how many more seconds), or let through (as the
    half-open trial or not)."""

    refused_for: float | None = None
    trial: bool = False


LET_THROUGH = Admission()


class Breaker:
    """The breakers of every shape that failed recently, least recently used first."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._shapes: OrderedDict[bytes, ShapeRecord] = OrderedDict()
        self._served: dict[str, float] = {}  # replica -> monotonic: the last request it served in full
        # replica -> its latest failures of two distinct shapes, newest first: (monotonic, shape)
        self._failures: dict[str, list[tuple[float, bytes]]] = {}
        self.refusals = 0  # requests refused by an open breaker, ever
        self.opened = 0  # breakers opened (a half-open one opening again counts), ever
        self.evicted = 0  # shapes dropped for room, ever

    def __len__(self) -> int:
        return len(self._shapes)

    @property
    def watching(self) -> bool:
        """Whether any shape is remembered: while none is, a request's shape need not even be computed."""
        return bool(self._shapes)

    # -- what the request path asks -------------------------------------------------------------------------------

    def admit(self, shape: bytes) -> Admission:
        """Whether a request of ``shape`` may go to an engine."""
        record = self._live(shape)
        if record is None or record.opened_until is None:
            return LET_THROUGH
        now = self._clock()
        if now < record.opened_until or record.trial:
            self.refusals += 1
            self._touch(shape, record, now)
            return Admission(refused_for=max(0.0, record.opened_until - now))
        record.trial = True  # half-open: this one request tells whether the input still fails
        self._touch(shape, record, now)
        return Admission(trial=True)

    def failed(self, shape: bytes, replica: str) -> None:
        """An engine answered an error of its own to a request of ``shape`` on ``replica``."""
        now = self._clock()
        record = self._live(shape)
        if record is None:
            record = ShapeRecord()
            self._shapes[shape] = record
            self._evict()
        record.failed[replica] = now
        self._touch(shape, record, now)
        earlier = [(at, other) for at, other in self._failures.get(replica, ()) if other != shape]
        self._failures[replica] = [(now, shape), *earlier[:1]]
        if record.opened_until is not None and now >= record.opened_until:
            self._open(record, now)  # the half-open trial (or a request let through with it) failed again
        elif record.opened_until is None and self._healthy_failures(shape, record, now) >= self.settings.replicas:
            self._open(record, now)

    def at_fault(self, shape: bytes, replica: str) -> bool:
        """Whether the input, not ``replica``, is to blame for the shape's error answer there: the shape's breaker
        opened, and the replica is otherwise healthy."""
        record = self._live(shape)
        return (record is not None and record.opened_until is not None
                and self._healthy(replica, shape, self._clock()))

    def served(self, replica: str, shape: bytes | None) -> None:
        """``replica`` served a request in full, without an error; of ``shape`` when known."""
        now = self._clock()
        self._served[replica] = now
        if len(self._served) > MAX_REPLICAS_REMEMBERED:  # names a discovery churned through
            for name in [name for name, at in self._served.items() if not self._recent(at, now)]:
                del self._served[name]
            for name in [name for name, failures in self._failures.items() if not self._recent(failures[0][0], now)]:
                del self._failures[name]
        if shape is not None:
            record = self._shapes.get(shape)
            if record is not None and (record.opened_until is None or now >= record.opened_until):
                del self._shapes[shape]  # it can be served: its failures were the engines'

    def trial_ended(self, shape: bytes) -> None:
        """The half-open trial ended without a verdict (the client left, a timeout): the next request tries."""
        record = self._shapes.get(shape)
        if record is not None:
            record.trial = False

    # -- what is seen from outside --------------------------------------------------------------------------------

    def open_count(self) -> int:
        """Shapes whose breaker refuses requests now (not half-open)."""
        now = self._clock()
        return sum(1 for r in self._shapes.values() if r.opened_until is not None and now < r.opened_until)

    # -- inside ---------------------------------------------------------------------------------------------------

    def _open(self, record: ShapeRecord, now: float) -> None:
        record.opened_until = now + self.settings.cooldown_seconds
        record.trial = False
        self.opened += 1

    def _live(self, shape: bytes) -> ShapeRecord | None:
        """The shape's record, unless it has expired (then it is dropped)."""
        record = self._shapes.get(shape)
        if record is not None and self._expired(record, self._clock()):
            del self._shapes[shape]
            return None
        return record

    def _expired(self, record: ShapeRecord, now: float) -> bool:
        """Neither open (nor half-open within a cooldown of its opening) nor failed within the window."""
        if record.opened_until is not None:
            return now >= record.opened_until + self.settings.cooldown_seconds and not record.trial
        return not self._recent(record.touched, now)

    def _touch(self, shape: bytes, record: ShapeRecord, now: float) -> None:
        record.touched = now
        self._shapes.move_to_end(shape)
        for replica in [r for r, at in record.failed.items() if not self._recent(at, now)]:
            del record.failed[replica]

    def _evict(self) -> None:
        while len(self._shapes) > self.settings.max_shapes:
            self._shapes.popitem(last=False)
            self.evicted += 1

    def _healthy_failures(self, shape: bytes, record: ShapeRecord, now: float) -> int:
        return sum(1 for replica in record.failed if self._healthy(replica, shape, now))

    def _healthy(self, replica: str, shape: bytes, now: float) -> bool:
        """Otherwise healthy: ``replica`` served a request in full within the window, or it has served one and
        failed no request of another shape since (idle). Served recently wins: a burst of different poisons meets
        a replica between two of its successes. One that never served anything is not known to work."""
        served = self._served.get(replica)
        if served is None:
            return False
        if self._recent(served, now):
            return True
        return not any(other != shape and at > served and self._recent(at, now)
                       for at, other in self._failures.get(replica, ()))

    def _recent(self, at: float, now: float) -> bool:
        return now - at <= self.settings.window_seconds


class BreakerCollector(Collector):
    """The breakers as Prometheus reads them, at scrape time, from the live ``Breaker``; and the verdicts, counted
    by the hook."""

    def __init__(self, breaker: Breaker, verdicts: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._breaker = breaker
        self._verdicts = verdicts

    def collect(self) -> Iterable[Metric]:
        breaker = self._breaker
        yield GaugeMetricFamily("appliance_breaker_open", "Request shapes whose circuit breaker is open now: "
                                "refused with 422 for breaker.cooldown_seconds.", value=breaker.open_count())
        yield GaugeMetricFamily("appliance_breaker_shapes", "Request shapes remembered (each failed on an engine "
                                "recently), at most breaker.max_shapes.", value=len(breaker))
        yield CounterMetricFamily("appliance_breaker_refusals", "Requests refused by an open breaker (422 "
                                  "request_fails_reproducibly) without reaching an engine.", value=breaker.refusals)
        yield CounterMetricFamily("appliance_breaker_opened", "Circuit breakers opened (a shape failed on "
                                  "breaker.replicas healthy replicas, or its half-open trial failed).",
                                  value=breaker.opened)
        yield CounterMetricFamily("appliance_breaker_evictions", "Shapes dropped from the breakers' LRU for room.",
                                  value=breaker.evicted)
        verdicts = CounterMetricFamily("appliance_breaker_verdicts", "Engine errors judged: fault=input (an error "
                                       "answer the request's input caused: not counted toward ejection), engine "
                                       "(counted), long_prefill (no first byte within the idle timeout from an "
                                       "engine that answers /health: not counted).", labels=["fault"])
        for fault, count in self._verdicts():
            verdicts.add_metric([fault], count)
        yield verdicts
