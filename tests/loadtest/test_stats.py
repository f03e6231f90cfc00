"""The statistics on synthetic data with known answers: percentiles, Wilson intervals, the SLA decision,
the bracket/bisection search, Student's t, least-squares trends and drift verdicts."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from appliance.loadtest.stats import (
    BracketSearch,
    betainc,
    bracket_converged,
    combine,
    decide,
    drift_verdict,
    linear_trend,
    percentile,
    summarize,
    t_two_sided_p,
    wilson_interval,
    z_value,
)

# --- percentiles -----------------------------------------------------------------------------------------------


def test_percentile_known_values() -> None:
    data = list(range(1, 11))
    assert percentile(data, 0) == 1
    assert percentile(data, 50) == 5.5
    assert percentile(data, 90) == pytest.approx(9.1)
    assert percentile(data, 100) == 10
    assert percentile([], 95) is None
    assert percentile([3.0], 99) == 3.0


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    data = [rng.expovariate(1.0) for _ in range(257)]
    for q in (1, 25, 50, 90, 95, 99, 99.9):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_summarize_empty_and_full() -> None:
    assert summarize([])["p95"] is None
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["count"] == 4 and s["mean"] == 2.5 and s["max"] == 4.0 and s["p50"] == 2.5


# --- Wilson interval and the decision --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("successes", "n", "lower", "upper"),
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (Wilson).
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_published_values(successes: int, n: int, lower: float, upper: float) -> None:
    lo, hi = wilson_interval(successes, n, 0.95)
    assert lo == pytest.approx(lower, abs=5e-5)
    assert hi == pytest.approx(upper, abs=5e-5)


def test_wilson_interval_edges() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(10 / (10 + 1.959964**2), abs=1e-6)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_z_values() -> None:
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert z_value(0.95, one_sided=True) == pytest.approx(1.644854, abs=1e-6)


@pytest.mark.parametrize(
    ("successes", "n", "verdict"),
    [
        (100, 100, "pass"),  # lower bound 0.974
        (99, 100, "pass"),  # lower bound 0.956
        (52, 52, "pass"),  # the smallest all-met sample that clears 95% one-sided: 52 / (52 + 1.645^2) = 0.9505
        (51, 51, "unresolved"),  # 51 / (51 + 1.645^2) = 0.9496
        (95, 100, "unresolved"),  # a sample P95 exactly at the threshold decides nothing
        (80, 100, "fail"),  # upper bound 0.857
        (10, 10, "unresolved"),  # below the minimum sample size, whatever the fraction
        (0, 40, "fail"),
    ],
)
def test_decide(successes: int, n: int, verdict: str) -> None:
    decision = decide(successes, n, target=0.95, confidence=0.95, min_samples=30)
    assert decision.verdict == verdict, decision.reason
    assert decision.lower <= (decision.fraction or 0) <= decision.upper


def test_combine() -> None:
    assert combine(["pass", "pass"]) == "pass"
    assert combine(["pass", "unresolved"]) == "unresolved"
    assert combine(["unresolved", "fail"]) == "fail"
    assert combine([]) == "unresolved"


# --- the search ------------------------------------------------------------------------------------------------


def _search(knee: int, max_value: int = 1024) -> tuple[BracketSearch, list[int]]:
    """Drive the search against a server that meets the SLA up to ``knee`` and not beyond."""
    search, probed = BracketSearch(max_value), []
    while (c := search.next()) is not None:
        probed.append(c)
        search.record(c, c <= knee)
    return search, probed


def test_search_finds_small_knee_exactly() -> None:
    search, probed = _search(37)
    assert probed == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert search.result == 37 and search.hi == 38


def test_search_stops_within_five_percent() -> None:
    search, probed = _search(300)
    assert search.result is not None and search.hi is not None
    assert search.result <= 300 < search.hi
    assert bracket_converged(search.result, search.hi)
    assert 300 - search.result <= max(1, 0.05 * search.result)
    assert len(probed) <= 16


def test_search_capped_and_infeasible() -> None:
    capped, probed = _search(10_000, max_value=100)
    assert capped.result == 100 and capped.hi is None and probed[-1] == 100
    infeasible, probed = _search(0)
    assert infeasible.result is None and probed == [1]


def test_search_reject_falls_back_to_previous_pass() -> None:
    search, _ = _search(37)
    search.reject(37)  # the confirming re-run did not reproduce the pass
    assert search.result == 36 and search.hi == 37 and search.next() is None


def test_search_reject_reopens_the_bracket() -> None:
    search, _ = _search(300)
    found = search.result
    search.reject(found)
    assert search.result is not None and search.result < found and search.hi == found
    # further bisection happens only while the bracket is wider than max(1, 5%)
    nxt = search.next()
    assert nxt is None or search.result < nxt < found


# --- Student's t and trends -------------------------------------------------------------------------------------


def _t_pdf(x: float, df: float) -> float:
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


def _t_p_by_integration(t: float, df: float) -> float:
    """Two-sided p by Simpson integration of the density: an independent check of the continued fraction."""
    n, a, b = 20_000, 0.0, abs(t)
    h = (b - a) / n
    area = _t_pdf(a, df) + _t_pdf(b, df) + sum((4 if i % 2 else 2) * _t_pdf(a + i * h, df) for i in range(1, n))
    return 1.0 - 2.0 * area * h / 3.0


@pytest.mark.parametrize(("t", "df", "p"), [(2.228, 10, 0.05), (12.706, 1, 0.05), (2.0, 10, 0.0734),
                                            (1.96, 1e6, 0.05), (0.0, 5, 1.0)])
def test_t_table_values(t: float, df: float, p: float) -> None:
    assert t_two_sided_p(t, df) == pytest.approx(p, abs=6e-4)


@pytest.mark.parametrize(("t", "df"), [(2.1213, 3), (0.7, 7), (3.5, 20)])
def test_t_matches_integration(t: float, df: float) -> None:
    assert t_two_sided_p(t, df) == pytest.approx(_t_p_by_integration(t, df), abs=1e-6)


def test_betainc_identities() -> None:
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)
    assert betainc(2.5, 0.5, 0.4) == pytest.approx(1 - betainc(0.5, 2.5, 0.6))
    assert betainc(3, 3, 0.5) == pytest.approx(0.5)


def test_linear_trend_textbook_example() -> None:
    # x = 1..5, y = 2, 4, 5, 4, 5: slope 0.6, intercept 2.2, SSR 2.4, se = sqrt(2.4 / 3 / 10), t = 2.1213 (df 3)
    trend = linear_trend([1, 2, 3, 4, 5], [2, 4, 5, 4, 5])
    assert trend.slope == pytest.approx(0.6)
    assert trend.intercept == pytest.approx(2.2)
    assert trend.stderr == pytest.approx(math.sqrt(0.08))
    assert trend.p_value == pytest.approx(_t_p_by_integration(0.6 / math.sqrt(0.08), 3), abs=1e-6)


def test_linear_trend_exact_lines() -> None:
    assert linear_trend([0, 1, 2, 3], [5, 5, 5, 5]).p_value == 1.0
    sloped = linear_trend([0, 1, 2, 3], [1, 3, 5, 7])
    assert sloped.slope == pytest.approx(2.0) and sloped.p_value == 0.0


# --- drift verdicts ---------------------------------------------------------------------------------------------

TIMES = [60.0 * i + 30 for i in range(20)]  # twenty one-minute windows


def _noisy(base: float, slope_per_window: float, noise: float, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    return [base + slope_per_window * i + rng.gauss(0, noise) for i in range(len(TIMES))]


def test_drift_flat_noise_is_stable() -> None:
    assert drift_verdict("ttft", TIMES, _noisy(100, 0, 3)).verdict == "stable"


def test_drift_steady_rise_is_drift() -> None:
    v = drift_verdict("ttft", TIMES, _noisy(100, 2.0, 3))  # +38% over the run
    assert v.verdict == "drift", v.reason
    assert v.p_value < 1e-6 and v.trend_change == pytest.approx(0.38, abs=0.06)


def test_drift_last_window_spike_is_suspect() -> None:
    values = [100.0] * 19 + [200.0]  # first-vs-last +20%, slope p ~ 0.1: one signal only
    v = drift_verdict("ttft", TIMES, values)
    assert v.verdict == "suspect", v.reason
    assert v.first_last_change == pytest.approx(0.2)
    assert v.p_value > 0.05


def test_drift_direction_down_for_throughput() -> None:
    falling = _noisy(1000, -10, 5)  # -19% over the run
    assert drift_verdict("tput", TIMES, falling, direction="down").verdict == "drift"
    rising = _noisy(1000, 10, 5)  # an improvement is not drift
    assert drift_verdict("tput", TIMES, rising, direction="down").verdict == "stable"


def test_drift_memory_exact_series() -> None:
    flat = [8e9] * 20
    assert drift_verdict("mem", TIMES, flat, tolerance=0.05).verdict == "stable"
    leak = [8e9 * (1 + 0.005 * i) for i in range(20)]  # +9.5% over the run, no noise
    v = drift_verdict("mem", TIMES, leak, tolerance=0.05)
    assert v.verdict == "drift" and v.p_value == 0.0


def test_drift_absolute_series_and_gaps() -> None:
    kv = [0.2 + 0.01 * i for i in range(20)]  # +0.19 occupancy
    assert drift_verdict("kv", TIMES, kv, tolerance=0.05, absolute=True).verdict == "drift"
    small = [0.2 + 0.001 * i for i in range(20)]  # +0.019: below the tolerance
    assert drift_verdict("kv", TIMES, small, tolerance=0.05, absolute=True).verdict == "stable"
    with_gaps = [None, 1.0, None, 1.0, 1.0]
    assert drift_verdict("x", TIMES[:5], with_gaps).verdict == "stable"
    assert drift_verdict("x", TIMES[:5], [None, None, 1.0, None, 2.0]).verdict == "insufficient"


def test_drift_needs_the_minimum_absolute_change() -> None:
    tiny = [0.004 * (1 + 0.02 * i) for i in range(20)]  # a 4 ms P95 rising 38%: only 1.5 ms
    assert drift_verdict("ttft", TIMES, tiny).verdict == "drift"
    assert drift_verdict("ttft", TIMES, tiny, min_change=0.005).verdict == "stable"
