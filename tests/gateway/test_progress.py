"""What streams show of their engines' progress: per replica, a moving average of the decode rate and time to first
token of recent legs, and the estimate it gives a request whose progress was never seen."""

from __future__ import annotations

from appliance.gateway.tenants.progress import PROMPT_WEIGHT, RECENT_SECONDS, WEIGHT, EngineProgress
from tests.doubles import FakeClock


def test_no_estimate_without_a_stream_on_that_replica() -> None:
    progress = EngineProgress(FakeClock())
    progress.learned("replica-0", rate=10.0, first_token=0.5)
    assert progress.completion("replica-1", sequences=1, seconds=5.0) is None


def test_the_estimate_is_the_rate_past_the_first_token_for_every_sequence() -> None:
    progress = EngineProgress(FakeClock())
    progress.learned("replica-0", rate=10.0, first_token=0.5)
    assert progress.completion("replica-0", sequences=1, seconds=2.5) == 20
    assert progress.completion("replica-0", sequences=3, seconds=2.5) == 60
    assert progress.completion("replica-0", sequences=1, seconds=0.3) == 0  # before the first token


def test_each_leg_moves_the_average_by_its_weight() -> None:
    progress = EngineProgress(FakeClock())
    progress.learned("replica-0", rate=10.0, first_token=1.0)
    progress.learned("replica-0", rate=20.0, first_token=2.0)
    rate, first = 10.0 + WEIGHT * 10.0, 1.0 + WEIGHT * 1.0
    assert progress.completion("replica-0", sequences=1, seconds=first + 10.0) == round(rate * 10.0)


def test_readings_go_stale_and_are_forgotten() -> None:
    clock = FakeClock()
    progress = EngineProgress(clock)
    progress.learned("replica-0", rate=10.0, first_token=0.5)
    clock.now += RECENT_SECONDS + 1
    assert progress.completion("replica-0", sequences=1, seconds=2.5) is None
    progress.learned("replica-1", rate=10.0, first_token=0.5)  # a new pod's name: the old one's reading goes
    assert list(progress._readings) == ["replica-1"]


def test_a_leg_without_a_pace_teaches_nothing() -> None:
    progress = EngineProgress(FakeClock())
    progress.learned("replica-0", rate=0.0, first_token=0.5)
    progress.learned("replica-0", rate=10.0, first_token=-1.0)  # a clock that went back
    assert progress.completion("replica-0", sequences=1, seconds=2.5) is None


def test_a_prompt_s_estimate_is_scaled_as_engines_counted_the_estimated_prompts_before_it() -> None:
    """Nothing counted yet: the estimate as it is. Then the engines' count over the gateway's estimate, both kept
    as moving sums, so a long prompt weighs more than a short one."""
    progress = EngineProgress(FakeClock())
    assert progress.prompt(100) == 100
    progress.prompt_counted(estimated=100, counted=120)
    assert progress.prompt(50) == 60
    progress.prompt_counted(estimated=1000, counted=1000)
    estimated, counted = 100 + PROMPT_WEIGHT * 900, 120 + PROMPT_WEIGHT * 880
    assert progress.prompt(1000) == round(1000 * counted / estimated)
    progress.prompt_counted(estimated=0, counted=5)  # nothing to compare: no change
    assert progress.prompt(1000) == round(1000 * counted / estimated)
    assert progress.prompt(1) >= 1
