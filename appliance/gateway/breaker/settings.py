"""The ``breaker`` section: the circuit breaker per request shape, and the long-prefill verdict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BreakerSettings(BaseModel):
    """Which errors are a request's own doing, and how long a request that keeps failing is refused (the
    ``appliance.gateway.breaker`` package)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Judge the engines' error answers (a 500, a 5xx error event) per request shape: an input "
        "that fails on `replicas` otherwise healthy replicas is the input's fault (never counted toward "
        "ejection) and is refused with 422 for `cooldown_seconds`. Off: every error answer counts as the replica's "
        "failure and is not tried elsewhere."
    )
    replicas: int = Field(
        2, ge=2, description="Distinct replicas, each otherwise healthy (it served a request within `window_seconds`, "
        "or served one before and failed no request of another shape since), a request shape must fail on before it is "
        "the input's fault and its breaker opens. A shape that failed on one is tried once more elsewhere to tell, "
        "when another replica is eligible."
    )
    window_seconds: float = Field(
        60.0, gt=0, description="How long failures are remembered, and how recent a replica's last full answer must "
        "be for it to count as healthy whatever else failed there. Once engines have failed everything for this "
        "long (an outage), the inputs are not blamed and every failure counts."
    )
    cooldown_seconds: float = Field(
        300.0, gt=0, description="How long an open breaker refuses its shape; then one request goes through as a "
        "trial (half-open): a failure opens it again at once, a success closes it."
    )
    max_shapes: int = Field(
        10_000, ge=1, description="Shapes remembered at most (only shapes that failed are), least recently used "
        "evicted first: about 450 bytes each."
    )
    long_prefill_health: bool = Field(
        True, description="A stream whose first byte does not come within gateway.upstream_idle_timeout_seconds is "
        "cut as before, but when its engine then answers /health (within engine.health_timeout_seconds) it is a "
        "long prefill, the request's own length: not counted toward ejection and not sent again elsewhere (it "
        "would be as long there); 504 `upstream_timeout`. Off: such a silence is the replica's failure."
    )
