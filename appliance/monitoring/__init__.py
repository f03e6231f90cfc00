"""Monitoring as code: Prometheus rules and Grafana dashboards rendered from alerts/config.yaml (``config`` reads
it, ``rules`` and ``dashboards`` generate, ``files`` writes and checks the generated files), the Alertmanager and
Prometheus configuration (``alertmanager``, ``prometheus``, ``bundle``), the local stack of `appliance up`
(``local``) and `appliance snapshot` (``snapshot``).

Generated rather than hand-written so that every threshold, SLO target, selector and runbook link lives in one
reviewed file, and CI can check the committed files for staleness. Kept light: importing this package imports
nothing else (the appliance's settings import ``monitoring.settings``).
"""
