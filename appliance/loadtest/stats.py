"""The statistics behind every verdict: percentiles, the SLA decision, the concurrency search, drift.

Pure functions on plain numbers, so each rule can be tested on synthetic data with a known answer and the
load-generating code never decides anything by itself.

* A P95 SLA ("P95 TTFT <= 800 ms") is the statement "at least 95% of requests meet 800 ms". A probe measures
  the fraction that did, and a Wilson score interval says how sure that is; a probe *passes* only when the
  interval's lower bound clears the target, *fails* when its upper bound is below it, and is *unresolved*
  otherwise (or when too few requests were measured). Comparing a sample P95 to the threshold, as most
  benchmarks do, calls a coin toss a verdict near the knee.
* The concurrency search doubles to bracket the knee, then bisects until the bracket is within max(1, 5%).
* Drift over a soak is judged twice: a least-squares slope with a t-test (is there a trend, and is it large
  over the run?) and a first-vs-last comparison (is the end worse than the start?). Both agreeing is "drift";
  one alone is "suspect".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal

Verdict = Literal["pass", "fail", "unresolved"]
DriftLabel = Literal["stable", "suspect", "drift", "insufficient"]

SUMMARY_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


# --- percentiles -------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's default).

    None for no data: an empty window must read as "no data", never as zero latency.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p95, p99 and max of a sample; None entries when it is empty."""
    data = list(values)
    out: dict[str, float | int | None] = {"count": len(data)}
    out["mean"] = sum(data) / len(data) if data else None
    out["min"] = min(data) if data else None
    for q in SUMMARY_PERCENTILES:
        out[f"p{q:g}"] = percentile(data, q)
    out["max"] = max(data) if data else None
    return out


# --- the SLA decision ----------------------------------------------------------------------------------------


def z_value(confidence: float, *, one_sided: bool = False) -> float:
    """The normal quantile for a confidence level (1.96 for 95% two-sided, 1.645 for 95% one-sided)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence}")
    tail = 1.0 - confidence if one_sided else (1.0 - confidence) / 2.0
    return NormalDist().inv_cdf(1.0 - tail)


def wilson_interval(successes: int, n: int, confidence: float = 0.95, *, z: float | None = None) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (two-sided at ``confidence`` unless ``z`` is given).

    Chosen over the normal (Wald) interval because it stays inside [0, 1] and keeps its coverage at the
    extremes (0 or n successes), which is exactly where SLA probes live: 99 of 100 requests on time.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    z = z_value(confidence) if z is None else z
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lower = 0.0 if successes == 0 else max(0.0, centre - half)
    upper = 1.0 if successes == n else min(1.0, centre + half)
    return lower, upper


@dataclass(frozen=True)
class Decision:
    """One SLA verdict with the numbers that justify it."""

    verdict: Verdict
    successes: int
    n: int
    fraction: float | None
    lower: float
    upper: float
    target: float
    confidence: float
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "successes": self.successes,
            "n": self.n,
            "fraction": self.fraction,
            "lower": self.lower,
            "upper": self.upper,
            "target": self.target,
            "confidence": self.confidence,
            "reason": self.reason,
        }


def decide(successes: int, n: int, *, target: float = 0.95, confidence: float = 0.95,
           min_samples: int = 30) -> Decision:
    """pass / fail / unresolved for "at least ``target`` of requests meet the threshold".

    Each side is a one-sided test at ``confidence``: pass when the lower Wilson bound >= target, fail when the
    upper bound < target. Below ``min_samples`` nothing is decided, because the interval's coverage is poor
    there and a verdict from a handful of requests is what makes capacity numbers irreproducible.
    """
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must be within (0, 1), got {target}")
    z = z_value(confidence, one_sided=True)
    lower, upper = wilson_interval(successes, n, z=z)
    fraction = successes / n if n else None
    pct = f"{100 * target:g}%"
    verdict: Verdict
    if n < min_samples:
        verdict, reason = "unresolved", f"{n} requests measured, fewer than the minimum {min_samples}"
    elif lower >= target:
        verdict, reason = "pass", f"{successes}/{n} met it; lower bound {lower:.4f} >= {pct}"
    elif upper < target:
        verdict, reason = "fail", f"{successes}/{n} met it; upper bound {upper:.4f} < {pct}"
    else:
        verdict = "unresolved"
        reason = f"{successes}/{n} met it; interval [{lower:.4f}, {upper:.4f}] contains {pct}"
    return Decision(verdict, successes, n, fraction, lower, upper, target, confidence, reason)


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """Several SLOs at once: any fail fails, all pass passes, anything else is unresolved."""
    if any(v == "fail" for v in verdicts):
        return "fail"
    if verdicts and all(v == "pass" for v in verdicts):
        return "pass"
    return "unresolved"


# --- the concurrency search ----------------------------------------------------------------------------------


def bracket_converged(lo: int, hi: int, rel_tol: float = 0.05) -> bool:
    """True when the bracket (lo passes, hi does not) is within max(1, rel_tol * lo)."""
    return hi - lo <= max(1.0, rel_tol * lo)


@dataclass
class BracketSearch:
    """The search for the largest passing concurrency: C=1, doubling until a probe does not pass, bisection.

    Kept free of I/O: the caller asks :meth:`next`, measures, and reports back with :meth:`record`. A value
    that does not pass (fail *or* unresolved) bounds the answer from above: the answer is the largest
    concurrency *shown* to meet the SLA. :meth:`reject` takes back a pass that a confirming re-run did not
    reproduce.
    """

    max_value: int
    rel_tol: float = 0.05
    start: int = 1
    lo: int | None = None
    hi: int | None = None
    passes: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_value < self.start or self.start < 1:
            raise ValueError(f"need 1 <= start <= max_value, got start={self.start}, max={self.max_value}")

    @property
    def stage(self) -> str:
        if self.lo is None and self.hi is None:
            return "feasibility"
        return "doubling" if self.hi is None else "bisection"

    def next(self) -> int | None:
        """The next concurrency to probe, or None when the search is over."""
        if self.lo is None:
            return self.start if self.hi is None else None
        if self.hi is None:
            return None if self.lo >= self.max_value else min(self.lo * 2, self.max_value)
        if bracket_converged(self.lo, self.hi, self.rel_tol):
            return None
        return (self.lo + self.hi) // 2

    def record(self, value: int, passed: bool) -> None:
        if passed:
            self.passes.add(value)
            if self.hi is not None and value >= self.hi:
                raise ValueError(f"{value} passed but {self.hi} did not: results are not monotonic")
            self.lo = value if self.lo is None else max(self.lo, value)
        else:
            self.hi = value if self.hi is None else min(self.hi, value)
            if self.lo is not None and self.lo >= value:
                self.lo = max((p for p in self.passes if p < value), default=None)

    def reject(self, value: int) -> None:
        """A confirming re-run at ``value`` did not pass: it now bounds the answer from above."""
        self.passes.discard(value)
        self.record(value, passed=False)

    @property
    def result(self) -> int | None:
        return self.lo


# --- trends and drift ----------------------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 / (1.0 + aa * d if abs(1.0 + aa * d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 / (1.0 + aa * d if abs(1.0 + aa * d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), enough of it for Student's t without scipy."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """Two-sided p-value of Student's t statistic with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError("degrees of freedom must be positive")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@dataclass(frozen=True)
class Trend:
    """Ordinary least-squares line y = intercept + slope * x, with the slope's t-test."""

    slope: float
    intercept: float
    stderr: float
    p_value: float
    n: int


def linear_trend(x: Sequence[float], y: Sequence[float]) -> Trend:
    """Least-squares slope and its two-sided p-value (H0: slope = 0); needs 3+ points with distinct x."""
    n = len(x)
    if n != len(y) or n < 3:
        raise ValueError("need at least 3 (x, y) pairs")
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    if sxx == 0:
        raise ValueError("x values are all equal")
    slope = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx
    intercept = my - slope * mx
    ssr = sum((yi - intercept - slope * xi) ** 2 for xi, yi in zip(x, y, strict=True))
    scale = max(abs(v) for v in y) or 1.0
    if ssr <= (1e-12 * scale) ** 2 * n:  # an exact line: a flat one means nothing, a sloped one is certain
        return Trend(slope, intercept, 0.0, 1.0 if abs(slope) * math.sqrt(sxx) <= 1e-12 * scale else 0.0, n)
    stderr = math.sqrt(ssr / (n - 2) / sxx)
    return Trend(slope, intercept, stderr, t_two_sided_p(slope / stderr, n - 2), n)


@dataclass(frozen=True)
class DriftVerdict:
    """The drift verdict for one soak series, with both tests' numbers."""

    series: str
    verdict: DriftLabel
    direction: str
    tolerance: float
    absolute: bool
    slope_per_s: float | None
    p_value: float | None
    trend_change: float | None
    first: float | None
    last: float | None
    first_last_change: float | None
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _change(start: float, end: float, absolute: bool) -> float:
    """end relative to start (a fraction), or their difference for series judged in absolute terms."""
    if absolute:
        return end - start
    return (end - start) / abs(start) if start else (math.inf if end > start else 0.0 if end == start else -math.inf)


def drift_verdict(
    series: str,
    times: Sequence[float],
    values: Sequence[float | None],
    *,
    direction: Literal["up", "down"] = "up",
    tolerance: float = 0.10,
    absolute: bool = False,
    alpha: float = 0.05,
    min_change: float = 0.0,
) -> DriftVerdict:
    """Is this soak series getting worse over time?

    ``direction`` says which way is bad (latency and memory "up", throughput "down"); ``tolerance`` is how
    much worse counts, relative to the start (or in the series' own units when ``absolute``, for ratios that
    start near zero). The trend test asks for a significant slope (p < alpha) whose change over the run is
    at least the tolerance; the edge test compares the mean of the first and last quarter of windows
    (at least one each). Either only counts when the change is also at least ``min_change`` in the series'
    own units (a P95 of 4 ms moving by 10% is jitter, not drift). Both agree: "drift"; one: "suspect";
    neither: "stable"; fewer than 3 points with data: "insufficient".
    """
    pairs = [(t, v) for t, v in zip(times, values, strict=True) if v is not None and math.isfinite(v)]
    sign = 1.0 if direction == "up" else -1.0
    empty = DriftVerdict(series, "insufficient", direction, tolerance, absolute, None, None, None, None, None, None,
                         f"{len(pairs)} windows with data; need 3")
    if len(pairs) < 3 or len({t for t, _ in pairs}) < 2:
        return empty
    xs, ys = [t for t, _ in pairs], [v for _, v in pairs]
    trend = linear_trend(xs, ys)
    start_fit = trend.intercept + trend.slope * xs[0]
    end_fit = trend.intercept + trend.slope * xs[-1]
    trend_change = _change(start_fit, end_fit, absolute)
    k = max(1, len(ys) // 4)
    first, last = sum(ys[:k]) / k, sum(ys[-k:]) / k
    edge_change = _change(first, last, absolute)
    trend_bad = (trend.p_value < alpha and sign * trend_change >= tolerance
                 and sign * (end_fit - start_fit) >= min_change)
    edge_bad = sign * edge_change >= tolerance and sign * (last - first) >= min_change
    unit = "" if absolute else " (relative)"
    detail = (f"slope p={trend.p_value:.3g}, change over run {trend_change:+.3g}{unit}; "
              f"first-vs-last {edge_change:+.3g}{unit}; tolerance {tolerance:g} {direction}")
    label: DriftLabel = "drift" if trend_bad and edge_bad else "suspect" if trend_bad or edge_bad else "stable"
    return DriftVerdict(series, label, direction, tolerance, absolute, trend.slope, trend.p_value, trend_change,
                        first, last, edge_change, detail)
