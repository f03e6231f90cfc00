"""The Batch API's alert (docs/batch.md): a batch that will miss, or missed, its completion window."""

from __future__ import annotations

from dataclasses import replace

from appliance.monitoring.alert import Alert, alert
from appliance.monitoring.config import MonitoringConfig


def batch_alerts(config: MonitoringConfig) -> list[Alert]:
    """The Batch API's alert (docs/batch.md), as two rules: a batch that will miss its completion window at the
    pace it was answered lately, and a batch that did (it expired). Batches live in one gateway's store: one
    alert per gateway, tenant and batch."""
    knob = config.alerts.ApplianceBatchWindowMissed
    hours, seconds = divmod(knob.horizon_seconds, 3600)
    horizon = f"{hours:g}h" if not seconds else f"{knob.horizon_seconds:g}s"
    by = "job, instance, tenant, batch"
    pending = f'max by ({by}) (appliance_batch_lines{{{{app}},state="pending"}})'
    pace = f'max by ({by}) (clamp_min(-deriv(appliance_batch_lines{{{{app}},state="pending"}}[{{window}}]), 0))'
    left = f"(max by ({by}) (appliance_batch_expiry_timestamp_seconds{{{{app}}}}) - time())"
    # The lines still pending when the window ends, at the pace of the last `window`; only in the window's last
    # horizon_seconds: earlier, idle capacity (nights, maintenance windows) may still come.
    will_miss = alert(
        config, "ApplianceBatchWindowMissed",
        f"(\n  {pending}\n  -\n  {pace}\n  * {left}\n) > 0\nand on ({by})\n{left} < {{horizon_seconds}}\n",
        "Batch {{ $labels.batch }} of tenant {{ $labels.tenant }} will miss its completion window.",
        "At the pace its lines were answered over the last {window}, batch {{ $labels.batch }} of tenant "
        '{{ $labels.tenant }} (gateway {{ $labels.instance }}) will still have about {{ $value | printf "%.0f" }} '
        "lines pending when its completion window ends, less than {horizon} from now: they will be answered "
        "batch_expired. Idle capacity is short of what the batch needs.", horizon=horizon)
    expired = alert(
        config, "ApplianceBatchWindowMissed",
        'max by (job, instance, tenant) (\n  max_over_time(appliance_batches{{app},status="expired"}[{window}])\n'
        '  -\n  min_over_time(appliance_batches{{app},status="expired"}[{window}])\n) > 0\n',
        "A batch of tenant {{ $labels.tenant }} missed its completion window.",
        "Batches of tenant {{ $labels.tenant }} expired on gateway {{ $labels.instance }} in the last {window} "
        '({{ $value | printf "%.0f" }}): the lines they had not answered in time are batch_expired errors in their '
        "error files.")
    return [will_miss, replace(expired, for_="0m")]  # an expiry is a fact: nothing to wait for
