"""``appliance capacity``: the largest concurrency whose P95 meets the SLA, then a soak at it.

The seed's method, made decidable: probe C=1 (can the SLA be met at all?), double until a probe does not
pass, bisect to within max(1, 5%), then re-run the answer to confirm it. Each probe is a closed-loop run at
concurrency C with a warm-up round excluded and at least ``min_rounds`` requests per worker; its verdict is
the Wilson-interval decision on the fraction of requests meeting each SLO (see ``stats.decide``), and an
unresolved probe is extended with more requests up to a cap before it counts as "not shown to pass".

The soak then holds the found concurrency for minutes, cuts the run into windows and judges drift in
latency, throughput, and (from the appliance's /metrics) memory and KV occupancy: a configuration that
passes a two-minute probe but leaks is not capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.loadtest.bench import (
    SLO,
    PromptSource,
    Target,
    evaluate_slo,
    execute,
    meets,
    summarize_results,
)
from appliance.loadtest.client import RequestResult, monotonic_clock
from appliance.loadtest.load import LoadSpec
from appliance.loadtest.metrics_scrape import SERIES_KEYS, MetricsPoller, Reading
from appliance.loadtest.stats import BracketSearch, DriftVerdict, decide, drift_verdict, percentile

# Windows with fewer requests than this have no P95 (it would be one request's latency).
MIN_WINDOW_REQUESTS = 10

# (series, direction that is bad, tolerance, absolute, min change): latency and throughput within 10% of the
# start (latency changes under 5 ms are jitter), host and device memory within 5%, KV occupancy within 0.05.
DRIFT_SERIES: tuple[tuple[str, Literal["up", "down"], float, bool, float], ...] = (
    ("ttft_p95_s", "up", 0.10, False, 0.005),
    ("e2e_p95_s", "up", 0.10, False, 0.005),
    ("output_tokens_per_s", "down", 0.10, False, 0.0),
    ("memory_bytes", "up", 0.05, False, 0.0),
    ("device_memory_bytes", "up", 0.05, False, 0.0),
    ("kv_usage", "up", 0.05, True, 0.0),
)


@dataclass(frozen=True)
class CapacityConfig:
    """The search's knobs; defaults follow the issue (5% resolution, 95% confidence)."""

    target: Target
    slo: SLO
    max_concurrency: int = 256
    requests_per_probe: int = 100
    max_requests_per_probe: int = 400
    min_rounds: int = 3
    confidence: float = 0.95
    min_samples: int = 30
    rel_tol: float = 0.05
    max_confirmations: int = 3
    client_retries: int = 2
    settle_s: float = 1.0
    seed: int = 0
    max_lag_s: float = 0.05
    soak_s: float = 0.0
    soak_window_s: float | None = None
    metrics_url: str | None = None
    metric_overrides: dict[str, str] = field(default_factory=dict)
    metrics_token: str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if not self.slo.items():
            raise ValueError("capacity needs at least one SLO")
        if self.max_concurrency < 1 or self.requests_per_probe < 1:
            raise ValueError("max_concurrency and requests_per_probe must be at least 1")
        if self.max_requests_per_probe < self.requests_per_probe:
            raise ValueError("max_requests_per_probe must be at least requests_per_probe")
        if self.client_retries < 0:
            raise ValueError("client_retries must be at least 0")

    @property
    def window_s(self) -> float:
        """Soak window: as asked, else 1/30 of the soak but at least 10 s (a 30-minute soak has 1-minute ones)."""
        return self.soak_window_s or max(10.0, self.soak_s / 30.0)


@dataclass
class Probe:
    """One concurrency measured: its verdict and why, with the numbers behind it."""

    id: int
    concurrency: int
    stage: str
    verdict: str
    reason: str
    batches: int
    summary: dict[str, Any]
    client: dict[str, Any]
    discarded: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "concurrency": self.concurrency, "stage": self.stage, "verdict": self.verdict,
                "reason": self.reason, "batches": self.batches, "summary": self.summary, "client": self.client,
                "discarded_batches": self.discarded}


@dataclass
class CapacityRun:
    """Everything the search and soak produced; ``rows`` are the per-request JSONL rows."""

    config: CapacityConfig
    probes: list[Probe] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    soak: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        """0 when a concurrency was found (and the soak, if any, did not drift or break the SLA); else 1."""
        if self.result.get("verdict") not in ("met", "capped"):
            return 1
        return 1 if self.soak is not None and self.soak["verdict"] in ("drift", "fail", "invalid") else 0


class CapacitySearch:
    """Runs probes against the target; one instance per ``appliance capacity`` invocation."""

    def __init__(self, config: CapacityConfig, prompts: PromptSource,
                 log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.prompts = prompts
        self.log = log or (lambda _msg: None)
        self.run = CapacityRun(config)

    async def probe(self, concurrency: int, stage: str) -> Probe:
        """Measure one concurrency, extending the sample while the verdict is unresolved (up to the cap).

        A batch the client could not drive (its scheduling or event loop fell behind: a CPU-starved client on a
        busy host) measures the client, not the server, so it is discarded and re-run after a settle pause, up to
        ``client_retries`` times; only then is the probe ``invalid``. Counting such a batch as "not passing"
        would let one stall on a shared host shrink the answer or end the search as ``unstable``."""
        cfg = self.config
        probe_id = len(self.run.probes)
        if probe_id and cfg.settle_s:  # let the requests the last probe cancelled leave the server
            await asyncio.sleep(cfg.settle_s)
        measured: list[RequestResult] = []
        discarded: list[str] = []
        window, batches, client, bottleneck, early = 0.0, 0, {}, None, None
        batch_size = max(cfg.requests_per_probe, cfg.min_rounds * concurrency)
        while True:
            spec = LoadSpec(concurrency=concurrency, requests=batch_size, warmup=concurrency,
                            seed=cfg.seed, max_lag_s=cfg.max_lag_s)
            rule = EarlyFail(cfg, measured, len(measured) + batch_size)
            run = await execute(cfg.target, spec, self.prompts, key_prefix=f"{cfg.seed}:p{probe_id}b{batches}",
                                progress=cfg.progress, label=f"C={concurrency} {stage}", check=False,
                                stop_when=rule)
            batches += 1
            client = run.client_report()
            bottleneck = run.client_bottleneck()
            self._keep_rows(run.results, probe_id, concurrency, stage, discarded=bottleneck)
            if bottleneck:
                if len(discarded) >= cfg.client_retries:
                    break
                discarded.append(bottleneck)
                self.log(f"probe {probe_id}: C={concurrency} batch {batches} discarded, re-run: {bottleneck}")
                if cfg.settle_s:
                    await asyncio.sleep(cfg.settle_s)
                continue
            measured += run.measured
            start = run.measure_start or 0.0
            window += (run.measure_end or start) - start
            if run.stopped_early:
                early = rule.reason()
                break
            sla = evaluate_slo(measured, cfg.slo, cfg.confidence, cfg.min_samples)
            if sla is None or sla["verdict"] != "unresolved" or len(measured) >= cfg.max_requests_per_probe:
                break
            batch_size = min(batch_size, cfg.max_requests_per_probe - len(measured))
        summary = summarize_results(measured, window, cfg.slo, cfg.confidence, cfg.min_samples)
        summary["early_stop"] = early
        verdict, reason = _probe_verdict(summary, bottleneck, len(discarded))
        if early and not bottleneck:
            # The partial sample's own decision ("unresolved", "fewer than the minimum") would contradict the
            # verdict: the early-stop rule is what decided, so it is the reason, with the P95s seen so far.
            verdict, reason = "fail", f"{early} ({_p95s(summary)} so far)"
        probe = Probe(probe_id, concurrency, stage, verdict, reason, batches, summary, client, discarded)
        self.run.probes.append(probe)
        self.log(f"probe {probe_id}: C={concurrency} ({stage}) -> {verdict}: {reason}")
        return probe

    def _keep_rows(self, results: Sequence[RequestResult], probe_id: int | str, concurrency: int, stage: str,
                   discarded: str | None = None) -> None:
        """Every request goes to requests.jsonl; those of a discarded batch say why they do not count."""
        extra = {"discarded": discarded} if discarded else {}
        for r in sorted(results, key=lambda r: r.index):
            self.run.rows.append({"probe": probe_id, "concurrency": concurrency, "stage": stage, **r.as_row(),
                                  **extra})

    async def search(self) -> dict[str, Any]:
        """C=1, doubling, bisection, confirmation; returns (and stores) the result section."""
        cfg = self.config
        bracket = BracketSearch(cfg.max_concurrency, cfg.rel_tol)
        await self._drive(bracket)
        confirmed = None
        for _ in range(cfg.max_confirmations):
            if bracket.result is None or self._invalid() is not None:
                break
            candidate = bracket.result
            if (await self.probe(candidate, "confirm")).verdict == "pass":
                confirmed = candidate
                break
            bracket.reject(candidate)
            await self._drive(bracket)
        self.run.result = self._result(bracket, confirmed)
        return self.run.result

    async def _drive(self, bracket: BracketSearch) -> None:
        while (concurrency := bracket.next()) is not None:
            stage = bracket.stage
            probe = await self.probe(concurrency, stage)
            if probe.verdict == "invalid":
                return  # the client cannot measure this host now: any further answer would describe the client
            bracket.record(concurrency, probe.verdict == "pass")

    def _invalid(self) -> Probe | None:
        return next((p for p in self.run.probes if p.verdict == "invalid"), None)

    def _result(self, bracket: BracketSearch, confirmed: int | None) -> dict[str, Any]:
        cfg = self.config
        invalid = self._invalid()
        if invalid is not None:
            return {"verdict": "invalid", "max_concurrency": None,
                    "reason": f"the client could not drive C={invalid.concurrency} in {len(invalid.discarded) + 1} "
                              f"tries ({invalid.reason}); give the client CPU of its own, or raise --max-lag-ms "
                              "if the SLA is far above the lag"}
        first = self.run.probes[0] if self.run.probes else None
        if confirmed is None and bracket.result is None and first is not None and first.concurrency == 1 \
                and first.verdict != "pass" and not any(p.verdict == "pass" for p in self.run.probes):
            return {"verdict": "unreachable", "max_concurrency": None,
                    "reason": f"the SLA is not shown to hold even at concurrency 1 ({first.verdict}: {first.reason})"}
        if confirmed is None:
            return {"verdict": "unstable", "max_concurrency": None,
                    "reason": f"no passing concurrency was confirmed by a re-run in {cfg.max_confirmations} tries"}
        bracket_hi = bracket.hi
        if bracket_hi is None:
            return {"verdict": "capped", "max_concurrency": confirmed, "upper_bound": None,
                    "reason": f"every probe up to --max-concurrency {cfg.max_concurrency} passed; "
                              "the real limit may be higher"}
        return {"verdict": "met", "max_concurrency": confirmed, "upper_bound": bracket_hi,
                "reason": f"C={confirmed} passed (and its confirming re-run); C={bracket_hi} did not"}

    async def soak(self, concurrency: int) -> dict[str, Any]:
        """Hold ``concurrency`` for the soak duration; windowed P95s, throughput, memory, KV and drift verdicts."""
        cfg = self.config
        if cfg.settle_s:
            await asyncio.sleep(cfg.settle_s)
        clock = monotonic_clock()
        window = cfg.window_s
        poller = MetricsPoller(cfg.metrics_url or "", min(window / 2.0, 15.0), clock, dict(cfg.metric_overrides),
                               token=cfg.metrics_token)
        stop = asyncio.Event()
        poll = asyncio.create_task(poller.run(stop)) if cfg.metrics_url else None
        spec = LoadSpec(concurrency=concurrency, duration=cfg.soak_s, warmup=concurrency, seed=cfg.seed,
                        max_lag_s=cfg.max_lag_s)
        try:
            run = await execute(cfg.target, spec, self.prompts, key_prefix=f"{cfg.seed}:soak", progress=cfg.progress,
                                label=f"soak C={concurrency}", check=False, clock=clock)
        finally:
            stop.set()
            if poll is not None:
                await poll
        self._keep_rows(run.results, "soak", concurrency, "soak")
        start = run.measure_start or 0.0
        windows = soak_windows(run.measured, poller.readings, start, window, cfg.soak_s)
        verdicts = drift_verdicts(windows)
        sla = evaluate_slo(run.measured, cfg.slo, cfg.confidence, cfg.min_samples)
        bottleneck = run.client_bottleneck()
        self.run.soak = {
            "concurrency": concurrency, "duration_s": cfg.soak_s, "window_s": window,
            "verdict": soak_verdict(verdicts, sla, bottleneck), "invalid_reason": bottleneck,
            "sla": sla, "drift": {v.series: v.as_dict() for v in verdicts}, "windows": windows,
            "metrics": poller.summary() if cfg.metrics_url else None, "client": run.client_report(),
            "summary": summarize_results(run.measured, (run.measure_end or start) - start, cfg.slo,
                                         cfg.confidence, cfg.min_samples),
        }
        self.log(f"soak at C={concurrency}: {self.run.soak['verdict']}")
        return self.run.soak


class EarlyFail:
    """Stops a probe once its verdict can only be "fail": even if every request still to come met the SLA,
    the decision on the planned sample would fail. Exact, not a sequential guess, so it costs no error rate;
    it saves most of a failing probe's time, which at high concurrency is the slowest part of the search."""

    def __init__(self, config: CapacityConfig, prior: Sequence[RequestResult], planned: int) -> None:
        self.config = config
        self.planned = planned
        self.seen = len(prior)
        self.misses = {m: sum(not meets(r, m, t) for r in prior) for m, t in config.slo.items()}

    def __call__(self, result: RequestResult) -> bool:
        self.seen += 1
        for metric, threshold in self.config.slo.items():
            self.misses[metric] += not meets(result, metric, threshold)
        return any(self._doomed(k) for k in self.misses.values())

    def _doomed(self, misses: int) -> bool:
        cfg = self.config
        best = decide(self.planned - misses, self.planned, target=cfg.slo.quantile, confidence=cfg.confidence,
                      min_samples=cfg.min_samples)
        return best.verdict == "fail"

    def reason(self) -> str:
        worst = max(self.misses, key=lambda m: self.misses[m])
        return (f"stopped after {self.seen} of {self.planned} requests: {self.misses[worst]} {worst} misses "
                "fail the SLA whatever the rest do")


def _probe_verdict(summary: dict[str, Any], bottleneck: str | None, discarded: int) -> tuple[str, str]:
    """A probe's verdict and a one-line reason naming the SLO that decided it."""
    if bottleneck:
        return "invalid", f"client bottleneck, not a server measurement: {bottleneck}"
    sla = summary["sla"]
    decisions = sla["decisions"]
    deciding = [m for m, d in decisions.items() if d["verdict"] == sla["verdict"]] or list(decisions)
    parts = [f"{m} P95 {_ms(summary['latency_s'][m]['p95'])}: {decisions[m]['reason']}" for m in deciding]
    errors = summary["errors"]
    if errors["count"]:
        parts.append(f"{errors['count']} errors ({', '.join(f'{k}: {v}' for k, v in errors['by_kind'].items())})")
    if discarded:
        parts.append(f"{discarded} batch(es) discarded first: client bottleneck")
    return sla["verdict"], "; ".join(parts)


def _p95s(summary: dict[str, Any]) -> str:
    return ", ".join(f"{m} P95 {_ms(summary['latency_s'][m]['p95'])}" for m in summary["sla"]["decisions"])


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def soak_windows(measured: Sequence[RequestResult], readings: Sequence[Reading], start: float, window_s: float,
                 duration_s: float) -> list[dict[str, Any]]:
    """Cut the soak into windows: requests by intended send time, tokens by completion time, scrapes by time.

    A trailing window shorter than half a window is dropped: its throughput would read low for no reason.
    """
    count = max(1, int(duration_s // window_s) + (1 if duration_s % window_s >= window_s / 2 else 0))
    windows = []
    for i in range(count):
        lo, hi = start + i * window_s, start + min((i + 1) * window_s, duration_s)
        reqs = [r for r in measured if lo <= r.intended < hi]
        ok = [r for r in reqs if r.ok]
        enough = len(ok) >= MIN_WINDOW_REQUESTS
        done = [r for r in measured if r.ok and r.end is not None and lo <= r.end < hi]
        windows.append({
            "index": i, "start_s": lo - start, "end_s": hi - start, "t_mid_s": (lo + hi) / 2 - start,
            "requests": len(reqs), "errors": len(reqs) - len(ok),
            "ttft_p50_s": percentile([r.ttft for r in ok if r.ttft is not None], 50) if enough else None,
            "ttft_p95_s": percentile([r.ttft for r in ok if r.ttft is not None], 95) if enough else None,
            "e2e_p95_s": percentile([r.e2e for r in ok if r.e2e is not None], 95) if enough else None,
            "output_tokens_per_s": sum(r.output_tokens for r in done) / max(hi - lo, 1e-9),
            **_scraped_means(readings, lo, hi),
        })
    return windows


def _scraped_means(readings: Sequence[Reading], lo: float, hi: float) -> dict[str, float | None]:
    """Each /metrics series' mean over the scrapes inside [lo, hi)."""
    out: dict[str, float | None] = {}
    for key in SERIES_KEYS:
        values = [v for r in readings if lo <= r.t < hi and (v := r.values.get(key)) is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


def drift_verdicts(windows: Sequence[dict[str, Any]]) -> list[DriftVerdict]:
    """One verdict per soak series (see ``stats.drift_verdict``)."""
    times = [w["t_mid_s"] for w in windows]
    return [drift_verdict(name, times, [w[name] for w in windows], direction=direction, tolerance=tol,
                          absolute=absolute, min_change=floor)
            for name, direction, tol, absolute, floor in DRIFT_SERIES]


def soak_verdict(verdicts: Sequence[DriftVerdict], sla: dict[str, Any] | None, bottleneck: str | None) -> str:
    """invalid (client bottleneck) > fail (SLA broken over the soak) > drift > suspect > stable."""
    if bottleneck:
        return "invalid"
    if sla is not None and sla["verdict"] == "fail":
        return "fail"
    labels = {v.verdict for v in verdicts}
    for label in ("drift", "suspect"):
        if label in labels:
            return label
    return "stable"


async def run_capacity(config: CapacityConfig, prompts: PromptSource,
                       log: Callable[[str], None] | None = None) -> CapacityRun:
    """The whole command: search, confirm, and soak at the answer when asked and found."""
    search = CapacitySearch(config, prompts, log)
    result = await search.search()
    if config.soak_s > 0 and result.get("max_concurrency"):
        await search.soak(int(result["max_concurrency"]))
    return search.run
