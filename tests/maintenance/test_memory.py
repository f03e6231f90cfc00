"""Memory signals: fragmentation over its threshold, resident-memory growth over the look-back, reset on restart."""

from appliance.maintenance.memory import MemoryReading, MemoryWatch


def watch(readings: dict) -> MemoryWatch:
    return MemoryWatch(lambda: readings, fragmentation_threshold=0.5, growth_threshold=0.5,
                       growth_lookback_seconds=100)


def test_fragmentation_over_threshold():
    readings = {"replica-0": MemoryReading(1, 100, 0.7), "replica-1": MemoryReading(2, 100, 0.2)}
    assert list(watch(readings).check(0)) == ["replica-0"]


def test_growth_against_the_lowest_reading_in_the_look_back_and_reset_by_a_restart():
    readings = {"replica-0": MemoryReading(1, 1000, None)}
    memory = watch(readings)
    assert memory.check(0) == {}
    readings["replica-0"] = MemoryReading(1, 1400, None)
    assert memory.check(50) == {}
    readings["replica-0"] = MemoryReading(1, 1600, None)
    assert "grew 60%" in memory.check(90)["replica-0"]
    readings["replica-0"] = MemoryReading(1, 1600, None)
    assert memory.check(160) == {}  # the 1000-byte reading left the look-back; 1600 vs 1400 is +14%
    readings["replica-0"] = MemoryReading(7, 2500, None)  # a new process: its own baseline
    assert memory.check(170) == {}


def test_a_failing_source_is_no_signal():
    def broken():
        raise OSError("gone")

    assert MemoryWatch(broken, fragmentation_threshold=0.5, growth_threshold=0.5,
                       growth_lookback_seconds=10).check(0) == {}


def test_growth_is_measured_from_readiness_not_from_the_starting_process():
    """Seen in CI: an engine's few megabytes while starting made its loaded model read as 103737% growth."""
    readings = {"replica-0": MemoryReading(1, 2_000_000, None, serving=False)}
    memory = watch(readings)
    assert memory.check(0) == {}
    readings["replica-0"] = MemoryReading(1, 2_000_000_000, None)  # ready: model and KV cache in memory
    assert memory.check(10) == {}
    readings["replica-0"] = MemoryReading(1, 2_400_000_000, None)
    assert memory.check(20) == {}  # +20%: under the threshold
    readings["replica-0"] = MemoryReading(1, 3_200_000_000, None)
    assert "grew 60%" in memory.check(30)["replica-0"]
