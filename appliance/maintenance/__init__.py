"""Maintenance: low-traffic rolling restarts on a schedule or when memory degrades, alert-driven runbook actions,
forward-progress liveness, and Grafana annotations of every action (see docs/maintenance.md)."""
