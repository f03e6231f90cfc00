"""The ``admission`` section: the adaptive limit, the queue, fair share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AdmissionSettings(BaseModel):
    """SLA-driven admission: a bounded gateway queue in front of an adaptive per-replica concurrency limit."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Off: every request goes straight to a replica (no 429s, no queue).")
    max_queue: int = Field(256, ge=0, description="Requests that may wait in the gateway; beyond it: 429.")
    queue_timeout_seconds: float = Field(
        10.0, gt=0, description="Longest a request waits in the gateway queue before a 429. The default favours "
        "answering late over refusing (batch clients, the CPU demo); for interactive traffic under a strict TTFT "
        "SLO set it below gateway.slo_ttft_p95_seconds (a request that waited longer can no longer make it)."
    )
    initial_limit: int | None = Field(
        None, ge=1, description="Starting concurrency limit per replica; default engine.max_num_seqs."
    )
    min_limit: int = Field(1, ge=1, description="The limit never drops below this.")
    max_limit: int | None = Field(None, ge=1, description="The limit never exceeds this; default engine.max_num_seqs.")
    decrease_factor: float = Field(0.9, gt=0, lt=1, description="Multiplicative cut when TTFT misses the target.")
    target_ttft_fraction: float = Field(
        0.8, gt=0, le=1, description="Per-request TTFT target as a fraction of gateway.slo_ttft_p95_seconds (headroom)."
    )
    slot_drift_seconds: float = Field(
        30.0, gt=0, description="How long the gateway may count more requests in flight at a replica than its "
        "engine reports running + waiting before that is slot drift (metric appliance_slot_drift, alert "
        "ApplianceSlotDrift; a replica full only by a drifted count makes /health/ready 503)."
    )
    fair_share: bool = Field(
        True, description="Order the queue by tenant priority, then fair share by weight (least served goes next), "
        "and bound a tenant's in-flight share of a replica while others want it. Off: one FIFO queue."
    )
    share_window_seconds: float = Field(
        2.0, ge=0, description="How long a tenant keeps its share of a replica after its requests there end: a "
        "client between two requests finds its room still free instead of behind a flood (capacity held idle at "
        "most this long after a tenant leaves). 0: a share lasts only while requests are held or queued."
    )
    over_share_prefills: int | None = Field(
        None, ge=1, description="A tenant that wants more of a replica (requests held there and queued, by "
        "weight) than another tenant that wants it may have at most this many streams there still in prefill (no "
        "first token yet): a flood whose clients leave at the first token keeps its whole share in prefill, and "
        "every prefill shares the engine's steps with the other tenants' requests. Unset: no cap beyond the share."
    )
