"""The tenants' accounting reconciled with the engines' own counters, per replica, all the time.

Two counters per replica and kind, side by side on the gateway's /metrics
(``appliance_tenant_reconciled_tokens_total{replica, kind, side}``):

- ``side="engine"``: what the engine's own ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` rose by,
  read from the gateway's engine poll (``appliance.engine.load``, about once a second). The first reading of a
  replica is its baseline; a counter that goes down is an engine that restarted, and its reading is a new baseline
  (the restart's own warm-up, made while the replica is drained, is not any tenant's). So the series only ever
  rises by what was seen between two readings of the same engine process.
- ``side="tenants"``: what the gateway charged tenants for work on that replica (``tenants.metering`` tells it at
  each request's end, leg by leg: a continued stream's legs go to their own replicas): the engines' usage reports
  and the gateway's estimates (a left stream's tail, a left non-streaming request's reservation), each prompt
  counted once per sequence it starts, as vLLM counts it (a request with ``n`` choices is ``n`` sequences that
  each prefill the prompt; its usage states the prompt once).

Work in flight makes the two differ for a while: the engine's counters rise as it works, a request is charged when
it ends. Rather than compare only when a replica is idle (a busy replica may never be) or guess the running usage
of every open request, the gateway exposes both counters as they are, and Prometheus compares their increases
over a window much longer than a request (``replica_kind:appliance_tenant_accounting_drift:ratio_rate<w>``, the
tenants' increase over the engine's, minus 1): the requests open at the window's two edges are the only
difference left, a small share of a busy window, and an alert only fires on a drift that lasts longer than the
window. Every request through the gateway is some tenant's (the default tenant's without keys; batch lines their
batch's tenant), and the gateway's own probes ask for no tokens; what reaches an engine around the gateway (a
shared external engine's other clients) shows as drift, as it should.

Work the gateway never saw (a non-streaming answer left or timed out, a stream's unread tail) is charged from an
estimate. Held for up to ``hold_seconds`` on its replica (``unseen``), it is charged instead as the engine counted
it when the replica next comes to rest (``settlement``): then both sides meet exactly, and the tenants' counters hold
what the engines did. A replica whose engine died comes to no rest: what its counters rose by after their last
reading died with them. Its held estimates are charged as estimated, but all together no more than that engine can
have made beyond what was charged there: its rise since its last rest plus its last rate over the time from its last
reading to the first poll it did not answer (``_settle_death``). A request that was still queued in the engine when
it died, and ran again elsewhere, is not charged twice for it.

``appliance_tenant_unseen_requests_total{replica, charged}`` says how each unseen request was charged (``engine``:
its share of what the engine counted; ``estimate``: as estimated, or within a dead engine's bound), and
``appliance_tenant_unseen_held{replica}`` how many wait for a rest.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.engine.load import EngineLoad
from appliance.gateway.tenants.settlement import Unseen, apportion, settle

KINDS = ("prompt", "completion")
SIDES = ("engine", "tenants")
# Estimates charged past the hold that a replica keeps for its next rest's top-ups; a replica busy for longer
# (about an hour of 1 such request a second) drops them, and its interval's estimates stand
MAX_EXPIRED = 4096
# A replica that stops answering the poll (its engine died and restarts: a minute or more) holds its estimates this
# many times as long, for its death's bound to apply to them when its new process first answers
SILENT_HOLD_FACTOR = 10
ENGINE, ESTIMATE = "engine", "estimate"  # how an unseen request was charged: its share of the engine's count, or not

Charge = Callable[[str, int], None]  # tenant, tokens: the tenants' accounting of work no engine reported


def _ignore(_tenant: str, _tokens: int) -> None:
    return None


def _no_legs(_name: str) -> int:
    return 0


@dataclass
class _Rest:
    """A replica since it was last at rest: both sides' totals then, and the estimates held since."""

    engine: tuple[float, float] = (0.0, 0.0)  # the engine's prompt and completion totals at the last rest
    tenants: tuple[float, float] = (0.0, 0.0)  # the tenants' side then
    finished: tuple[float, float] = (0.0, 0.0)  # sequences finished then: as the engine counted, as reported
    held: list[Unseen] = field(default_factory=list)
    expired: list[Unseen] = field(default_factory=list)  # charged as estimated since: at rest, topped up if short
    untracked: bool = False  # expired estimates dropped (MAX_EXPIRED): the interval's counters hold unknown errors
    idle: bool = False  # the last reading found the replica idle
    told: int = 0  # charges told for the replica when it was last read


class Reconciliation(Collector):
    """Both sides' running totals per replica, and the engine's last reading each rose from. Fed by the engine
    poll (``observe``) and the metering hook (``charged``), read at scrape (``collect``)."""

    def __init__(self, charge: Charge = _ignore, *, hold_seconds: float = 0.0,
                 open_legs: Callable[[str], int] = _no_legs, clock: Callable[[], float] = time.monotonic,
                 other_gateways: bool = False) -> None:
        """``charge``: where an unseen request's tokens are charged to its tenant, once, when settled or
        estimated. ``hold_seconds``: how long an estimate waits for its replica to come to rest (0: charged as
        estimated at once). ``open_legs``: the gateway's requests open on a replica now (a replica with one is not
        at rest). ``other_gateways``: other gateways send to the same engines (they share a quota store)."""
        self.engine: dict[str, list[float]] = {}  # replica -> [prompt, completion] the engine counted since seen
        self.tenants: dict[str, list[float]] = {}  # replica -> [prompt, completion] charged for work there
        self.finished: dict[str, list[float]] = {}  # replica -> sequences finished: [engine's count, reported]
        self._last: dict[str, tuple[float, float, float | None]] = {}  # replica -> its counters at its last reading
        self._read_at: dict[str, float] = {}  # replica -> when its last reading came
        self._rates: dict[str, tuple[float, float]] = {}  # replica -> its counters' rise a second between its last two
        self._silent: dict[str, float] = {}  # replica -> its first unanswered poll since its last reading
        self._rests: dict[str, _Rest] = {}
        self._told: Counter[str] = Counter()  # replica -> charges and estimates told for it
        self.unseen_charged: Counter[tuple[str, str]] = Counter()  # (replica, how) -> unseen requests charged
        self.charge = charge
        self.hold_seconds = hold_seconds
        self.open_legs = open_legs
        self.clock = clock
        self.other_gateways = other_gateways

    def observe(self, name: str, load: EngineLoad | None) -> None:
        """One poll of ``name``'s /metrics. An unanswered poll or a page without the counters changes no total:
        the next reading's increase covers the gap (and the replica is not at rest until two readings say so); the
        first since a reading is kept, the moment its engine was gone by if a new process answers next."""
        at = self.clock()
        if load is None or load.prompt_tokens_total is None or load.generation_tokens_total is None:
            if name in self._rests:
                self._rests[name].idle = False
            if name in self._last:
                self._silent.setdefault(name, at)
            return
        now = (load.prompt_tokens_total, load.generation_tokens_total, load.finished_total)
        last, read_at, silent = self._last.get(name), self._read_at.get(name), self._silent.pop(name, None)
        self._last[name], self._read_at[name] = now, at
        totals = self._side(self.engine, name)
        if last is None or now[0] < last[0] or now[1] < last[1]:
            # The baseline, or a new engine process whose reading is the new baseline (the old one's count went
            # with it): what was held there is charged as estimated, within what the old engine can have made
            if last is not None and read_at is not None and silent is not None:
                self._settle_death(name, silent - read_at)
            self._estimate_held(name)
            self._rates.pop(name, None)
            self._rests[name] = self._rest_now(name)
            return
        if read_at is not None and at > read_at:
            self._rates[name] = ((now[0] - last[0]) / (at - read_at), (now[1] - last[1]) / (at - read_at))
        totals[0] += now[0] - last[0]
        totals[1] += now[1] - last[1]
        if now[2] is not None and last[2] is not None and now[2] >= last[2]:
            self._side(self.finished, name)[0] += now[2] - last[2]
        still = now[:2] == last[:2] and now[2] is not None and now[2] == last[2]
        self._settle(name, load, still)

    def charged(self, name: str, prompt: int, completion: int, finished: int = 0) -> None:
        """Tokens charged to a tenant for work on replica ``name`` (prompt counted once per sequence), and the
        sequences among them that the engine finished (their usage came back)."""
        self._told[name] += 1
        self._count(name, prompt, completion)
        if finished:
            self._side(self.finished, name)[1] += finished

    def unseen(self, name: str, tenant: str, n: int, prompt: int, completion: int, room: int) -> None:
        """Work of ``tenant``'s request on replica ``name`` that no engine reported, as the gateway estimated it
        (``prompt`` once per sequence, ``n`` choices a prompt, ``room``: the most completion the engine could have
        made for it): held until the replica comes to rest, or charged as estimated."""
        self._told[name] += 1
        item = Unseen(tenant, max(1, n), max(0, prompt), max(0, completion), max(0, room), self.clock())
        rest = self._rests.get(name)
        if self.hold_seconds <= 0 or rest is None or rest.untracked:
            self._charge(name, item, item.prompt, item.completion, ESTIMATE)
            return
        rest.held.append(item)

    def _settle(self, name: str, load: EngineLoad, still: bool) -> None:
        """At rest (idle over two readings, counters still, nothing told in between), the unseen requests since
        the last rest take their shares of what the engine counted beyond the reports: the held ones are charged
        theirs, the ones charged as estimated before (held too long) the part of theirs they fell short by (a
        counter never goes down: an estimate above its share stays, and shows as drift). Then the replica's
        interval starts again."""
        rest = self._rests[name]
        idle = load.running == 0 and load.waiting == 0 and self.open_legs(name) == 0
        at_rest = idle and still and rest.idle and rest.told == self._told[name]
        rest.idle, rest.told = idle, self._told[name]
        if not at_rest:
            return
        finished = self.finished.get(name, [0.0, 0.0])
        shares, unseen = None, rest.expired + rest.held
        if unseen and not rest.untracked and self._only_ours(finished, rest, unseen):
            estimated = (sum(item.prompt for item in rest.expired), sum(item.completion for item in rest.expired))
            uncovered = self._uncovered(name, rest)
            shares = settle(unseen, *(uncovered[k] + estimated[k] for k in (0, 1)))
        if shares is None:
            self._estimate_held(name)
        else:
            expired = len(rest.expired)
            for index, (item, (prompt, completion)) in enumerate(zip(unseen, shares, strict=True)):
                if index >= expired:
                    self._charge(name, item, prompt, completion, ENGINE)
                else:
                    self._add(name, item, max(0, prompt - item.prompt), max(0, completion - item.completion))
        self._rests[name] = self._rest_now(name)
        self._rests[name].idle, self._rests[name].told = True, self._told[name]

    def _settle_death(self, name: str, gap: float) -> None:
        """``name``'s engine died within ``gap`` seconds of its last reading: the estimates it held are charged,
        all together no more than it can have made that no charge covers, each within its own estimate. The
        bound holds with other clients on the engine too: their work can only widen it."""
        rest = self._rests.get(name)
        if rest is None or not rest.held or rest.untracked:
            return
        rate, uncovered = self._rates.get(name, (0.0, 0.0)), self._uncovered(name, rest)
        held, rest.held = rest.held, []
        estimates = ([item.prompt for item in held], [item.completion for item in held])
        shares = []
        for k, caps in enumerate(estimates):
            room = uncovered[k] + rate[k] * max(0.0, gap)
            shares.append(apportion(min(sum(caps), max(0, round(room))), caps, caps))
        for item, prompt, completion in zip(held, *shares, strict=True):
            self._charge(name, item, prompt, completion, ESTIMATE)

    def _uncovered(self, name: str, rest: _Rest) -> tuple[float, float]:
        """What ``name``'s engine counted since ``rest`` beyond everything charged there since, per kind."""
        engine, tenants = self.engine.get(name, [0.0, 0.0]), self.tenants.get(name, [0.0, 0.0])
        prompt = (engine[0] - rest.engine[0]) - (tenants[0] - rest.tenants[0])
        return prompt, (engine[1] - rest.engine[1]) - (tenants[1] - rest.tenants[1])

    def _only_ours(self, finished: list[float], rest: _Rest, unseen: list[Unseen]) -> bool:
        """Whether the sequences the engine finished since the last rest can all be this gateway's requests: those
        whose usage came back, and, alone in front of the engine, unseen ones its engine finished just as their
        clients left (the answer on its way, never read), at most one per choice of each. With other gateways an
        excess is as likely theirs: none is allowed."""
        excess = (finished[0] - rest.finished[0]) - (finished[1] - rest.finished[1])
        return 0 <= excess <= (0 if self.other_gateways else sum(item.n for item in unseen))

    def _rest_now(self, name: str) -> _Rest:
        engine, tenants = self.engine.get(name, [0.0, 0.0]), self.tenants.get(name, [0.0, 0.0])
        finished = self.finished.get(name, [0.0, 0.0])
        return _Rest((engine[0], engine[1]), (tenants[0], tenants[1]), (finished[0], finished[1]))

    def _estimate_held(self, name: str, before: float | None = None) -> None:
        """What ``name`` held (since before ``before``, or all), charged as estimated."""
        rest = self._rests.get(name)
        if rest is None:
            return
        due = [item for item in rest.held if before is None or item.at <= before]
        for item in due:
            self._charge(name, item, item.prompt, item.completion, ESTIMATE)
        rest.held = rest.held[len(due):]
        rest.expired += due
        if len(rest.expired) > MAX_EXPIRED:
            rest.expired, rest.untracked = [], True

    def _charge(self, name: str, item: Unseen, prompt: int, completion: int, how: str) -> None:
        self._add(name, item, prompt, completion)
        self.unseen_charged[(name, how)] += 1

    def _add(self, name: str, item: Unseen, prompt: int, completion: int) -> None:
        if prompt or completion:
            self._count(name, prompt, completion)
            self.charge(item.tenant, item.charge(prompt, completion))

    def _count(self, name: str, prompt: float, completion: float) -> None:
        """The tenants' side of replica ``name`` rises by what was charged there."""
        if prompt or completion:
            totals = self._side(self.tenants, name)
            totals[0] += prompt
            totals[1] += completion

    def expire(self) -> None:
        """Estimates held longer than ``hold_seconds`` (their replica busy without a pause, or unread) are
        charged as estimated: a tenant's counters lag its work by at most that long (``SILENT_HOLD_FACTOR`` times
        as long while their replica does not answer). At the next rest, one that fell short of its share is
        topped up."""
        now = self.clock()
        for name, rest in self._rests.items():
            deadline = now - self.hold_seconds * (SILENT_HOLD_FACTOR if name in self._silent else 1)
            if rest.held and rest.held[0].at <= deadline:
                self._estimate_held(name, before=deadline)

    def retain(self, names: Collection[str]) -> None:
        """Forget replicas gone from the fleet (their series stop; a request still finishing there brings its
        tenants' side back until the next poll forgets it again)."""
        for name in [name for name in self._rests if name not in names]:
            self._estimate_held(name)
        for table in (self.engine, self.tenants, self.finished, self._last, self._read_at, self._rates, self._silent,
                      self._rests, self._told):
            for name in [name for name in table if name not in names]:
                del table[name]
        self.expire()

    def drift(self, name: str) -> tuple[float, float]:
        """Tenants' side minus engine's side since first seen, per kind (prompt, completion): 0 when every
        request there has ended and the engine's counters have been read since."""
        engine, tenants = self.engine.get(name, [0.0, 0.0]), self.tenants.get(name, [0.0, 0.0])
        return tenants[0] - engine[0], tenants[1] - engine[1]

    @staticmethod
    def _side(table: dict[str, list[float]], name: str) -> list[float]:
        totals = table.get(name)
        if totals is None:
            totals = table[name] = [0.0, 0.0]
        return totals

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "appliance_tenant_reconciled_tokens", "Tokens per replica and kind (prompt, completion) as the engine "
            "counted them (side=engine: the rise of vllm:prompt_tokens_total / vllm:generation_tokens_total seen by "
            "the gateway's poll, reset-safe) and as the gateway charged them to tenants (side=tenants: prompts once "
            "per sequence, estimates included); compare their increases over a window.",
            labels=["replica", "kind", "side"])
        for name in sorted(self.engine.keys() | self.tenants.keys()):
            for side, table in (("engine", self.engine), ("tenants", self.tenants)):
                totals = table.get(name, [0.0, 0.0])
                for kind, value in zip(KINDS, totals, strict=True):
                    family.add_metric([name, kind, side], value)
        yield family
        unseen = CounterMetricFamily(
            "appliance_tenant_unseen_requests", "Requests with work no engine reported (a non-streaming answer left "
            "or timed out, a stream's unread tail), by replica and how they were charged: charged=engine, their "
            "share of what the engine counted once its replica came to rest; charged=estimate, the gateway's "
            "estimate (no rest in time, or the engine's counters held other work; where its engine died, within what "
            "that engine can have made).", labels=["replica", "charged"])
        for (name, how), count in sorted(self.unseen_charged.items()):
            unseen.add_metric([name, how], count)
        yield unseen
        held = GaugeMetricFamily("appliance_tenant_unseen_held", "Requests whose unseen work waits for its "
                                 "replica to come to rest, to be charged as the engine counted it.", labels=["replica"])
        for name, rest in sorted(self._rests.items()):
            held.add_metric([name], len(rest.held))
        yield held
