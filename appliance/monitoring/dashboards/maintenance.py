"""Appliance / Maintenance: what happened to the replicas? Restarts, crashes, drains, state, model load, and the
streams the gateway moved off replicas that died or were drained (stream migration)."""

from __future__ import annotations

from typing import Any

from appliance.monitoring.config import MonitoringConfig
from appliance.monitoring.dashboards.board import Section, Selectors, dashboard, resolve
from appliance.monitoring.dashboards.panels import (
    heatmap,
    increase,
    increase_by,
    runbooks,
    stat,
    state_timeline,
    target,
    timeseries,
)

UID = "appliance-maintenance"
NOT_READY, DRAIN_STUCK, HUNG = "ApplianceReplicaNotReady", "ApplianceDrainStuck", "ApplianceReplicaHung"

REPLICA_STATES = (("ready", "green"), ("starting", "blue"), ("unhealthy", "orange"), ("draining", "yellow"),
                  ("backoff", "red"), ("stopping", "purple"), ("stopped", "text"))


def build(config: MonitoringConfig | None = None) -> dict[str, Any]:
    config = resolve(config)
    sel = Selectors.of(config)
    gw, gw_replica = sel.gateway, sel.gateway_replica
    owners, owners_replica = sel.owners, sel.owners_replica  # replica states: each engine once (no gateway pods)
    coded = " + ".join(f'{i} * sum by (replica) (appliance_replica_state{{{owners_replica}, state="{name}"}})'
                       for i, (name, _) in enumerate(REPLICA_STATES, 1))
    panels = [
        stat(1, "Ready replicas", target(f'sum(appliance_replica_state{{{owners}, state="ready"}})'), unit="none",
             thresholds=[(None, "red"), (1, "green")], links=runbooks(config, "ApplianceNoReadyReplica"),
             description="Replicas in the ready state."),
        stat(2, "Draining", target(f'sum(appliance_replica_state{{{owners}, state="draining"}})'), unit="none",
             thresholds=[(None, "green"), (1, "yellow")], links=runbooks(config, DRAIN_STUCK),
             description="Replicas draining: finishing in-flight requests, receiving no new ones."),
        stat(3, "Hung replicas", target(f"sum(appliance_replica_hung{{{gw}}})"), unit="none",
             thresholds=[(None, "green"), (1, "red")], links=runbooks(config, HUNG),
             description="Replicas whose engine is alive but makes no progress (the maintenance watchdog)."),
        stat(4, "Restarts", target(increase("appliance_replica_restarts_total", gw_replica)),
             unit="none", thresholds=[(None, "green"), (1, "orange"), (3, "red")],
             description="Replica restarts (crash recovery and maintenance) in the latest interval."),
        stat(5, "Last restart", target(f"max(appliance_replica_last_restart_timestamp_seconds{{{gw_replica}}}) * 1000"),
             unit="dateTimeFromNow",
             description="When any selected replica last restarted (absent until one has restarted)."),
        stat(6, "Next maintenance window",
             target(f"min(appliance_maintenance_next_window_timestamp_seconds{{{gw}}}) * 1000"),
             unit="dateTimeFromNow",
             description="Start of the next scheduled low-traffic maintenance window (rolling restarts)."),
        state_timeline(7, "Replica state", coded, "{{replica}}", REPLICA_STATES,
                       links=runbooks(config, NOT_READY, DRAIN_STUCK),
                       description="Each replica's life-cycle state over time: starting until /health answers, "
                                   "ready, unhealthy after failed probes, draining, backoff after a crash."),
        timeseries(8, "Restarts and crashes",
                   increase_by("appliance_replica_restarts_total", gw_replica, "replica", "restarts"),
                   increase_by("appliance_replica_crashes_total", gw_replica, "replica", "crashes"),
                   increase_by("appliance_replica_starts_total", gw_replica, "replica", "starts"),
                   increase_by("appliance_replica_spawn_failures_total", gw_replica, "replica", "spawn failures"),
                   unit="none", links=runbooks(config, "ApplianceRestartLoop", "ApplianceReplicaSpawnFailing"),
                   description="Engine starts, restarts, unrequested exits and failed spawns (the engine process "
                               "could not even be started) per interval; crashes that repeat are a restart loop."),
        timeseries(9, "Model load time", target(f"appliance_replica_model_load_seconds{{{gw_replica}}}",
                                                "{{replica}}"), unit="s",
                   thresholds=[(None, "green"), (config.alerts.ApplianceSlowModelLoad.threshold_seconds, "red")],
                   links=runbooks(config, "ApplianceSlowModelLoad"),
                   description="Seconds from spawning a replica's engine to its first healthy answer; slow loads "
                               "point at weights on network storage or a cold page cache."),
        timeseries(10, "Time since last restart",
                   target(f"time() - appliance_replica_last_restart_timestamp_seconds{{{gw_replica}}}", "{{replica}}"),
                   unit="s", description="Age of each replica's current engine since its latest restart."),
        timeseries(11, "Drains",
                   target(f'sum by (replica) (appliance_replica_state{{{owners_replica}, state="draining"}})',
                          "draining {{replica}}"),
                   increase_by("appliance_maintenance_actions_total", gw + ', action=~"drain.*"', "result",
                               "drain actions"),
                   unit="none", links=runbooks(config, DRAIN_STUCK),
                   description="1 while a replica drains, and drain actions taken by maintenance "
                                            "per interval; a drain that stays at 1 is stuck."),
        timeseries(12, "Maintenance actions",
                   increase_by("appliance_maintenance_actions_total", gw, "action, trigger, result"),
                   unit="none", description="Drains, restarts and rolling restarts per interval, by trigger "
                                            "(admin, schedule, alert) and result (ok, failed, aborted, dry_run, "
                                            "rate_limited, skipped)."),
        timeseries(13, "Hung flag by replica", target(f"appliance_replica_hung{{{gw_replica}}}", "{{replica}}"),
                   unit="none", min_=0, max_=1, links=runbooks(config, HUNG),
                   description="1 while a replica is judged hung (requests in flight, no tokens produced)."),
        timeseries(14, "Readiness", target(f'sum(appliance_replica_state{{{owners}, state="ready"}})', "ready"),
                   target(f'count(appliance_replica_state{{{owners}, state="ready"}})', "replicas"),
                   unit="none", links=runbooks(config, "ApplianceNoReadyReplica", NOT_READY),
                   description="Ready replicas against configured replicas; the gap is capacity lost "
                                            "to restarts, drains and failures."),
        timeseries(15, "Alerts received by the webhook",
                   target(increase("appliance_alert_webhook_alerts_total", gw, by="alertname, status, action"),
                          "{{alertname}} {{status}} -> {{action}}"),
                   unit="none", description="Alertmanager notifications the appliance's webhook received per "
                                            "interval, and the action it chose (none, duplicate, or the "
                                            "whitelisted maintenance action)."),
        timeseries(16, "Slot surplus over the engine",
                   target(f"appliance_slot_surplus{{{gw_replica}}}", "surplus {{replica}}"),
                   target(f"appliance_slot_drift{{{gw_replica}}}", "drift {{replica}}"),
                   increase_by("appliance_slot_orphans_returned_total", gw, "replica", "orphans returned"),
                   increase_by("appliance_slot_leases_reclaimed_total", gw, "replica", "leases reclaimed"),
                   unit="none", min_=0, links=runbooks(config, "ApplianceSlotDrift"),
                   description="Requests the gateway counts in flight at a replica beyond what its engine reports "
                               "running + waiting (short spikes are normal), 1 while that surplus has lasted "
                               "admission.slot_drift_seconds, and slots the gateway's own safety nets returned "
                               "(both should stay 0)."),
        timeseries(17, "Stream migrations",
                   increase_by("appliance_stream_migrations_total", gw, "reason, outcome"),
                   target(increase("appliance_stream_migration_replayed_tokens_total", gw), "tokens replayed"),
                   unit="none", description="Broken answers the gateway tried to continue on another replica per "
                                            "interval, by why they broke (connection, idle_timeout, engine_error, "
                                            "drain) and what came of it (continued; failed, ineligible, exhausted: "
                                            "the client got an error event), and the tokens the new replicas "
                                            "prefilled again (prompt + tokens already sent)."),
        heatmap(18, "Stream migration added latency", "appliance_stream_migration_added_seconds", gw, unit="s",
                description="From a stream's break to the first event of its continuation relayed to the client: "
                            "the pause a client sees when its engine dies mid-answer."),
    ]
    by_id = {panel["id"]: panel for panel in panels}
    sections = [Section(101, "Replicas now", [by_id[i] for i in (1, 2, 3, 4, 5, 6)]),
                Section(102, "Life cycle", [by_id[i] for i in (7, 8, 9, 10)]),
                Section(103, "Drains, hangs and maintenance", [by_id[i] for i in (11, 12, 13, 14, 15, 16)]),
                Section(104, "Stream migration", [by_id[i] for i in (17, 18)])]
    return dashboard(UID, "Appliance / Maintenance",
                     "What happened to the replicas? Restarts, crashes, drains, state, model load, maintenance.",
                     sections, ["maintenance"], sel)
