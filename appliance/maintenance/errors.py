"""Why a maintenance action was refused. Maintenance raises these; the HTTP layer maps them to status codes in
one place (``appliance.app``), and the scheduler and the alert webhook record them with their ``result``:
``skipped`` (try again later: busy, not enough capacity now) or ``refused`` (never for this trigger)."""

from __future__ import annotations


class MaintenanceError(Exception):
    code = "maintenance_error"
    result = "skipped"  # how the schedule and the webhook record it

    @property
    def message(self) -> str:
        return str(self)


class ReplicaNotFound(MaintenanceError):
    code = "replica_not_found"


class MaintenanceBusy(MaintenanceError):
    code = "maintenance_in_progress"


class NotSupervised(MaintenanceError):
    code = "not_supervised"


class BelowMinReady(MaintenanceError):
    """The action would leave fewer than ``maintenance.min_ready_replicas`` replicas routable."""

    code = "min_ready_replicas"


class LastRoutableReplica(BelowMinReady):
    """An alert-driven action would take the last routable replica: alerts are forgeable, so only an operator
    (the admin API) may do that."""

    code = "last_routable_replica"
    result = "refused"
