"""The maintenance job under a controllable clock: the window and the traffic gate both have to allow a rolling
restart; a fragmentation trigger waits for low traffic, never the window, never peak."""

from datetime import UTC, datetime, timedelta

from tests.maintenance.support import Rig

UTC = UTC


def test_no_restart_outside_the_window_even_when_quiet():
    rig = Rig(datetime(2026, 12, 2, 12, 0, tzinfo=UTC))
    rig.run(30, rate=0)
    assert rig.restarts() == [0, 0]


def test_no_restart_in_the_window_while_traffic_is_above_the_threshold():
    rig = Rig(datetime(2026, 12, 2, 2, 50, tzinfo=UTC))
    decisions = rig.run(40, rate=5)
    assert rig.restarts() == [0, 0]
    assert any(d.startswith("waiting: request rate") for d in decisions)


def test_restart_once_per_window_when_window_and_traffic_allow():
    rig = Rig(datetime(2026, 12, 2, 2, 50, tzinfo=UTC))
    rig.run(15, rate=5)  # busy until 03:05: the window opened but traffic is high
    assert rig.restarts() == [0, 0]
    rig.run(15, rate=0)  # quiet from 03:05: a look-back later the rolling restart runs, once
    assert rig.restarts() == [1, 1]
    rig.run(40, rate=0)  # the rest of this window: nothing more
    assert rig.restarts() == [1, 1]
    rig.clock.set(datetime(2026, 12, 3, 3, 0, tzinfo=UTC))  # the next night's window
    rig.run(5, rate=0)
    assert rig.restarts() == [2, 2]
    assert rig.registry.get_sample_value("appliance_maintenance_actions_total", {
        "action": "rolling_restart", "trigger": "schedule", "result": "ok"}) == 2


def test_the_queue_counts_as_traffic():
    rig = Rig(datetime(2026, 12, 2, 3, 0, tzinfo=UTC))
    rig.queue = 2
    rig.run(10, rate=0)
    assert rig.restarts() == [0, 0]


def test_disabled_never_restarts_on_its_own():
    rig = Rig(datetime(2026, 12, 2, 3, 0, tzinfo=UTC))
    rig.settings.enabled = False
    rig.fragmentation = 0.9
    rig.run(20, rate=0)
    assert rig.restarts() == [0, 0]
    assert rig.scheduler.next_window() is None


def test_fragmentation_wants_a_restart_that_waits_for_low_traffic_outside_the_window():
    rig = Rig(datetime(2026, 12, 2, 12, 0, tzinfo=UTC))
    rig.fragmentation = 0.9
    decisions = rig.run(20, rate=5)  # peak: wanted, but never at peak
    assert rig.restarts() == [0, 0]
    assert "replica-1: fragmentation 0.90" in rig.scheduler.status()["restart_wanted"]
    assert decisions[-1].startswith("waiting")
    rig.fragmentation = 0.1
    rig.run(0.5, rate=0)  # quiet, but not for a whole look-back yet
    assert rig.restarts() == [0, 0]
    rig.run(2, rate=0)
    assert rig.restarts() == [1, 1]
    assert rig.scheduler.wanted is None


def test_next_window():
    rig = Rig(datetime(2026, 12, 2, 12, 0, tzinfo=UTC))
    assert rig.scheduler.next_window() == datetime(2026, 12, 3, 3, 0, tzinfo=UTC)
    rig.clock.set(datetime(2026, 12, 3, 3, 10, tzinfo=UTC))
    assert rig.scheduler.next_window() == datetime(2026, 12, 3, 3, 0, tzinfo=UTC)  # open and not yet done
    assert rig.scheduler.status()["in_window"]
    rig.run(2, rate=0)
    rig.clock.advance(60)
    rig.run(1, rate=0)
    assert rig.restarts() == [1, 1]
    assert rig.scheduler.next_window() == datetime(2026, 12, 3, 3, 0, tzinfo=UTC) + timedelta(days=1)


def test_memory_triggered_restarts_do_not_loop():
    rig = Rig(datetime(2026, 12, 2, 12, 0, tzinfo=UTC), memory_restart_min_interval_seconds=3600)
    rig.fragmentation = 0.9  # and it stays high after the restart
    rig.run(5, rate=0)
    assert rig.restarts() == [1, 1]
    rig.run(50, rate=0)
    assert rig.restarts() == [1, 1]
    rig.run(15, rate=0)  # an hour after the first one
    assert rig.restarts() == [2, 2]
