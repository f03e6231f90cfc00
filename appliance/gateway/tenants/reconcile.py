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
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.engine.load import EngineLoad

KINDS = ("prompt", "completion")
SIDES = ("engine", "tenants")


class Reconciliation(Collector):
    """Both sides' running totals per replica, and the engine's last reading each rose from. Fed by the engine
    poll (``observe``) and the metering hook (``charged``), read at scrape (``collect``)."""

    def __init__(self) -> None:
        self.engine: dict[str, list[float]] = {}  # replica -> [prompt, completion] the engine counted since seen
        self.tenants: dict[str, list[float]] = {}  # replica -> [prompt, completion] charged for work there
        self._last: dict[str, tuple[float, float]] = {}  # replica -> the engine's counters at its last reading

    def observe(self, name: str, load: EngineLoad | None) -> None:
        """One poll of ``name``'s /metrics. An unanswered poll or a page without the counters changes nothing:
        the next reading's increase covers the gap."""
        if load is None or load.prompt_tokens_total is None or load.generation_tokens_total is None:
            return
        now = (load.prompt_tokens_total, load.generation_tokens_total)
        last = self._last.get(name)
        self._last[name] = now
        totals = self._side(self.engine, name)
        if last is None:
            return  # the baseline
        if now[0] < last[0] or now[1] < last[1]:
            return  # a new engine process: its reading is the new baseline
        totals[0] += now[0] - last[0]
        totals[1] += now[1] - last[1]

    def charged(self, name: str, prompt: int, completion: int) -> None:
        """Tokens charged to a tenant for work on replica ``name`` (prompt counted once per sequence)."""
        if prompt or completion:
            totals = self._side(self.tenants, name)
            totals[0] += prompt
            totals[1] += completion

    def retain(self, names: Collection[str]) -> None:
        """Forget replicas gone from the fleet (their series stop; a request still finishing there brings its
        tenants' side back until the next poll forgets it again)."""
        for table in (self.engine, self.tenants, self._last):
            for name in [name for name in table if name not in names]:
                del table[name]

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
