"""Tests of the alerting rules, their promtool tests, the runbooks and the Alertmanager config."""
