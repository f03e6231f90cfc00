"""Precise prefix routing's alert (docs/tuning.md, section 5): a replica's KV-cache event stream lost."""

from __future__ import annotations

from appliance.monitoring.alert import Alert, alert
from appliance.monitoring.config import MonitoringConfig

# Why a replica's KV event index was emptied because its events were lost for good (appliance_routing_kv_index_resets):
# not a restart, a cleared cache or a resync, which are the engine's own news.
KV_EVENT_LOSSES = "replay_gap|replay_failed|undecodable|malformed"


def kv_events_alerts(config: MonitoringConfig) -> list[Alert]:
    """Precise prefix routing's alert (docs/tuning.md, section 5), as two rules: an event stream lost (the index of
    a ready replica not routed on for a while) and events lost again and again. Its series exist only while
    ``routing.prefix_cache.mode`` is precise or precise-with-fallback, so in approximate mode it cannot fire. Each
    gateway subscribes to every engine itself: one alert per gateway and replica."""
    lost = alert(
        config, "ApplianceKVEventsLost",
        "max by ({by}) (appliance_routing_kv_index_usable{{app}}) == 0\n"
        "and on (job, instance, replica)\n"
        'max by ({by}) (appliance_replica_state{{app},state="ready"}) == 1\n',
        "Precise prefix routing has lost the KV events of {{ $labels.replica }}.",
        "For {for_} the gateway at {{ $labels.instance }} has had no usable KV-cache event index for the ready "
        "replica {{ $labels.replica }} (appliance_routing_kv_index_usable 0): it gets no events from that engine, "
        "or cannot bring its index back in step. Requests there are routed without precise prefix scores: the "
        "approximate scorer's in precise-with-fallback, no prefix affinity at all in precise.")
    flapping = alert(
        config, "ApplianceKVEventsLost",
        f'sum by ({{by}}) (increase(appliance_routing_kv_index_resets_total{{{{app}},reason=~"{KV_EVENT_LOSSES}"}}'
        "[{window}])) >= {losses}\n",
        "Precise prefix routing keeps losing the KV events of {{ $labels.replica }}.",
        "The gateway at {{ $labels.instance }} lost the KV events of {{ $labels.replica }} for good "
        '{{ $value | printf "%.0f" }} times in the last {window} (gaps no replay filled, replays that failed, '
        "batches it could not decode): each time the replica's index started again empty, was not routed on for "
        "routing.prefix_cache.resync_seconds, and then missed every block cached before.")
    return [lost, flapping]
