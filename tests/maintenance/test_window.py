"""The window: in/out from cron + duration, time zones and DST, next start, crontab day-of-week numbers."""

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from appliance.maintenance.window import MaintenanceWindow

UTC = UTC


def at(text: str, tz=UTC) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=tz)


def test_in_and_out_of_a_nightly_window():
    window = MaintenanceWindow("0 3 * * *", 3600)
    assert not window.contains(at("2026-12-02 02:59:59"))
    assert window.contains(at("2026-12-02 03:00:00"))
    assert window.contains(at("2026-12-02 03:59:59"))
    assert not window.contains(at("2026-12-02 04:00:00"))
    assert window.current_start(at("2026-12-02 03:30:00")) == at("2026-12-02 03:00:00")


def test_the_window_is_read_in_its_time_zone():
    window = MaintenanceWindow("0 3 * * *", 1800, "America/New_York")
    # 03:00 in New York in December is 08:00 UTC.
    assert not window.contains(at("2026-12-02 03:10:00"))
    assert window.contains(at("2026-12-02 08:10:00"))
    assert window.contains(at("2026-12-02 03:10:00", ZoneInfo("America/New_York")))
    # In July (daylight saving time) it is 07:00 UTC.
    assert window.contains(at("2026-07-01 07:10:00"))


def test_a_window_spanning_midnight():
    window = MaintenanceWindow("30 23 * * *", 3600)
    assert window.contains(at("2026-12-03 00:15:00"))
    assert window.current_start(at("2026-12-03 00:15:00")) == at("2026-12-02 23:30:00")


def test_next_start():
    window = MaintenanceWindow("0 3 * * *", 3600, "Europe/Berlin")
    assert window.next_start(at("2026-12-02 01:00:00")) == at("2026-12-02 02:00:00")  # 03:00 CET
    assert window.next_start(at("2026-12-02 02:30:00")) == at("2026-12-03 02:00:00")  # inside: the next one


def test_day_of_week_numbers_mean_what_crontab_means():
    sundays = MaintenanceWindow("0 3 * * 0", 3600)
    assert sundays.next_start(at("2026-12-02 12:00:00")) == at("2026-12-06 03:00:00")  # 2026-12-06 is a Sunday
    weekdays = MaintenanceWindow("0 3 * * 1-5", 3600)
    assert weekdays.next_start(at("2026-12-05 12:00:00")) == at("2026-12-07 03:00:00")  # Saturday -> Monday


def test_naive_times_and_bad_expressions_are_refused():
    with pytest.raises(ValueError):
        MaintenanceWindow("0 3 * * *", 60).contains(datetime(2026, 12, 2, 3))
    with pytest.raises(ValueError):
        MaintenanceWindow("0 3 * *", 60)
