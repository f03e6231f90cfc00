"""The Grafana dashboards, as code: panel builders and the dashboards on-call opens.

Dashboards are generated, not hand-edited, so that every panel follows the same conventions (a datasource
variable, ``$__rate_interval``, units and descriptions, heatmaps for histograms, rows, runbook links) and a
reviewer reads a diff of Python instead of thousands of lines of JSON. Grafana loads the files through file
provisioning (``dashboards/provisioning``), so uids and panel ids are fixed here: links, bookmarks and
``appliance snapshot`` rely on them. Every SLO, alert threshold and scrape-job selector comes from
alerts/config.yaml (:mod:`appliance.monitoring.config`), so a panel shows what the alert pages on.

Panels query raw metrics rather than recording rules: a dashboard must keep working while rule names evolve,
and Grafana's own ``$__rate_interval`` then matches the scrape interval exactly.

Modules: ``panels`` (builders), ``board`` (variables, annotations, rows, layout), one module per dashboard
(``overview``, ``capacity``, ``hardware``, ``maintenance``, ``tenants``), ``catalogue`` (all of them by uid, as
dicts) and ``write`` (the files and ``python -m appliance.monitoring.dashboards --write|--check``).
"""

from appliance.monitoring.dashboards.board import DATASOURCE_UID, SCHEMA_VERSION
from appliance.monitoring.dashboards.catalogue import DASHBOARDS, build_dashboards
from appliance.monitoring.dashboards.write import generated, main, render, stale, write
from appliance.paths import DASHBOARDS_DIR

__all__ = ["DASHBOARDS", "DASHBOARDS_DIR", "DATASOURCE_UID", "SCHEMA_VERSION", "build_dashboards", "generated",
           "main", "render", "stale", "write"]
