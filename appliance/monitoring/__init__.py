"""Monitoring as code: Prometheus rules rendered from alerts/config.yaml (``rules``), the Alertmanager
configuration rendered from its template and the environment (``alertmanager``), and the dashboards and local
Prometheus/Alertmanager that use them.

Generated rather than hand-written so that every threshold, SLO target and runbook link lives in one reviewed
file, and CI can check the committed files for staleness.
"""
