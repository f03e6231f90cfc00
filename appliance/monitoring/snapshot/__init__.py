"""``appliance snapshot``: a dashboard's panels rendered from Prometheus data to PNG files and one HTML page.

Incidents need pictures that outlive Prometheus' retention and can be attached to a ticket, and hosts without
Grafana (the embedded default, CI) still need to see the dashboards. This reads the same dashboard JSON that
Grafana provisions, runs each panel's queries against Prometheus with Grafana's variables substituted the way
Grafana would, and draws each panel with matplotlib: close enough to read the incident, never a second source
of truth for what a panel shows.

Output (``--out DIR``): ``index.html`` (title, time range, every panel image with its description, under its
row's heading), ``results.json`` (the raw Prometheus results per target) and ``panels/*.png``. It is written to a
temporary folder beside DIR and renamed into place, so DIR is either absent, the previous snapshot, or this one
complete. Exit codes: 0 written, 1 written but some queries failed, 2 usage error (unknown dashboard, bad time
range, unreachable Prometheus, DIR not empty) with nothing written.

Modules: ``timerange`` (what the user typed, resolved as Grafana would), ``query`` (the Prometheus client and
the panels' results), ``render`` (PNG, HTML, results.json), ``take`` (one snapshot, atomically) and ``cli``
(``appliance snapshot``, registered by appliance/cli.py through :func:`register`).
"""

from appliance.exit_codes import EXIT_OK, EXIT_USAGE
from appliance.monitoring.snapshot.cli import EXIT_QUERY_FAILED, cmd_snapshot, main, register
from appliance.monitoring.snapshot.query import PanelResult, Prometheus, Series, legend, run_queries
from appliance.monitoring.snapshot.render import format_value, render_panel, write_snapshot
from appliance.monitoring.snapshot.take import SnapshotRequest, load_dashboard, snapshot
from appliance.monitoring.snapshot.timerange import SnapshotError, TimeRange, parse_duration, parse_time

__all__ = ["EXIT_OK", "EXIT_QUERY_FAILED", "EXIT_USAGE", "PanelResult", "Prometheus", "Series", "SnapshotError",
           "SnapshotRequest", "TimeRange", "cmd_snapshot", "format_value", "legend", "load_dashboard", "main",
           "parse_duration", "parse_time", "register", "render_panel", "run_queries", "snapshot", "write_snapshot"]
