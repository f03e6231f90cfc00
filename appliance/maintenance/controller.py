"""The one place maintenance actions go through, whoever asks (admin API, schedule, alert webhook).

It serialises them (one rolling restart at a time, never two restarts of one replica, restarts asked for by
alerts one at a time), and it is the one place that keeps routable capacity: no drain or restart, whoever asks,
may leave fewer than ``min_ready_replicas`` replicas serving (capped at replicas - 1, so that a single-replica
appliance can still be restarted: its requests wait in the queue meanwhile), and an alert never takes the last
one. That minimum is this host's; a node pod's rolling restarts also need the fleet-wide restart lease of its
``coordinator`` (appliance/maintenance/coordination.py). Serving means what the router would use: routable
and not ejected (a router in panic sends everything to an ejected replica once the others are gone, which is no
capacity). Alerts can be forged by anyone who reaches
Alertmanager, so these guards sit here, under every path, not in the webhook. It records each action the same
way: a log line, ``appliance_maintenance_actions_total``, a Grafana annotation, and the last action shown by
/admin/status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from appliance.engine.contract import Replica
from appliance.maintenance.annotations import Annotator
from appliance.maintenance.coordination import LocalCoordinator, RestartCoordinator
from appliance.maintenance.errors import (
    BelowMinReady,
    LastRoutableReplica,
    MaintenanceBusy,
    NotSupervised,
    ReplicaNotFound,
)
from appliance.maintenance.metrics import MaintenanceMetrics
from appliance.maintenance.rolling import Outcome, RestartProcedure, RollingRestart

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActionRecord:
    action: str
    trigger: str
    result: str
    replica: str | None
    detail: str
    at: float  # unix time


class MaintenanceController:
    def __init__(self, replicas: Callable[[], Sequence[Replica]], procedure: RestartProcedure, *, min_ready: int,
                 metrics: MaintenanceMetrics, annotator: Annotator | None = None,
                 is_hung: Callable[[str], bool] = lambda _name: False,
                 is_ejected: Callable[[str], bool] = lambda _name: False,
                 coordinator: RestartCoordinator | None = None) -> None:
        """``is_ejected(name)``: the router's own ejection of a replica (not softened by its panic mode).
        ``coordinator``: who else must agree to each replica's restart in a rolling restart (a node pod's
        fleet-wide lease; see appliance/maintenance/coordination.py); default: nobody (one host)."""
        self._replicas = replicas
        self.procedure = procedure
        self.min_ready = min_ready
        self.metrics = metrics
        self.annotator = annotator or Annotator(None)
        self.is_hung = is_hung
        self.is_ejected = is_ejected
        self.coordinator = coordinator or LocalCoordinator()
        self.rolling: RollingRestart | None = None
        self.restarting: set[str] = set()
        self.last_action: ActionRecord | None = None
        self.last_restart: dict[str, float] = {}  # replica -> unix time it was last restarted by maintenance
        self._tasks: set[asyncio.Task[Outcome]] = set()

    # -- what is going on -------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.rolling is not None or bool(self.restarting)

    def status(self) -> dict[str, Any]:
        return {
            "rolling_restart_in_progress": self.rolling is not None,
            "rolling_restart_current": self.rolling.current if self.rolling else None,
            "restarting": sorted(self.restarting),
            "last_action": asdict(self.last_action) if self.last_action else None,
            "last_restart": max(self.last_restart.values()) if self.last_restart else None,
        }

    # -- actions ----------------------------------------------------------------------------------------------

    def start_rolling_restart(self, trigger: str, reason: str = "",
                              then: Callable[[Outcome], None] | None = None) -> asyncio.Task[Outcome]:
        """Run a rolling restart in the background; MaintenanceBusy if maintenance is already under way,
        LastRoutableReplica if an alert asks it of a single replica. ``then(outcome)`` runs when it ends, before
        the controller takes the next action (a reload undoes its staging there, no other reload in between)."""
        self.check_rolling_restart(trigger)
        if self.busy:
            raise MaintenanceBusy("a restart is already in progress")
        # Alerts never take the last serving replica: each restart then needs at least one other serving.
        min_ready = max(1, self.min_ready) if trigger == "alert" else self.min_ready
        self.rolling = RollingRestart(self._replicas, self.procedure, min_ready=min_ready, is_ejected=self.is_ejected,
                                      coordinator=self.coordinator,
                                      on_replica=lambda r, o: self._replica_done(r, o, trigger))
        return self._spawn(self._rolling(trigger, reason, then), "rolling-restart")

    def check_rolling_restart(self, trigger: str) -> None:
        """What refuses a rolling restart whenever it would run (busy aside, which passes): NotSupervised, and
        LastRoutableReplica for an alert on a single replica. The webhook asks before it schedules one."""
        replicas = self._replicas()
        self._check_supervised(replicas)
        if trigger == "alert" and len(replicas) < 2:
            raise LastRoutableReplica("rolling restart refused: the only replica is the last routable one, and "
                                      "alerts never take that (an operator can, through the admin API)")

    def start_restart(self, name: str, trigger: str, reason: str = "") -> asyncio.Task[Outcome]:
        """Drain, restart, warm and undrain one replica in the background (ReplicaNotFound, MaintenanceBusy,
        NotSupervised, BelowMinReady, LastRoutableReplica when it cannot)."""
        replica = self.replica(name)
        self._check_supervised([replica])
        if self.rolling is not None or name in self.restarting:
            raise MaintenanceBusy(f"{name} is already being restarted")
        if trigger == "alert" and self.restarting:
            busy = ", ".join(sorted(self.restarting))
            raise MaintenanceBusy(f"restarts asked for by alerts run one at a time; {busy} is being restarted")
        self._check_capacity(replica, "restart", trigger)
        self.restarting.add(name)
        return self._spawn(self._restart(replica, trigger, reason), f"restart-{name}")

    def drain(self, name: str, trigger: str) -> Replica:
        replica = self.replica(name)
        self._check_capacity(replica, "drain", trigger)
        replica.drain()
        self.record("drain", trigger, "ok", replica=name)
        return replica

    def undrain(self, name: str, trigger: str) -> Replica:
        """MaintenanceBusy while maintenance restarts that replica: routed to before the restart, its requests
        would be killed by it; the restart returns it to routing itself once it is warmed."""
        replica = self.replica(name)
        if self.restarting_now(name):
            raise MaintenanceBusy(f"{name} is being restarted by maintenance; it returns to routing by itself once "
                                  "it is ready and warmed")
        replica.undrain()
        self.record("undrain", trigger, "ok", replica=name)
        return replica

    def record(self, action: str, trigger: str, result: str, *, replica: str | None = None, detail: str = "") -> None:
        self.last_action = ActionRecord(action, trigger, result, replica, detail, time.time())
        self.metrics.action(action, trigger, result)
        target = f" {replica}" if replica else ""
        message = f"maintenance: {action}{target} ({trigger}): {result}" + (f": {detail}" if detail else "")
        log.log(logging.INFO if result in ("ok", "dry_run") else logging.WARNING, message)
        tags = ["maintenance", action, trigger, result] + ([replica] if replica else [])
        self.annotator.annotate(message, tags)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.annotator.close()
        await self.coordinator.close()

    def replicas(self) -> Sequence[Replica]:
        return self._replicas()

    def restarting_now(self, name: str) -> bool:
        """Maintenance is restarting ``name``: on its own or as the rolling restart's current replica."""
        return name in self.restarting or (self.rolling is not None and self.rolling.current == name)

    def serving(self, replica: Replica) -> bool:
        """Capacity the router would use: routable, not ejected, not being restarted (its drain may not have run
        yet)."""
        return replica.routable and not self.is_ejected(replica.name) and replica.name not in self.restarting

    def replica(self, name: str) -> Replica:
        for replica in self._replicas():
            if replica.name == name:
                return replica
        raise ReplicaNotFound(f"no replica named '{name}'")

    # -- internals --------------------------------------------------------------------------------------------

    async def _rolling(self, trigger: str, reason: str, then: Callable[[Outcome], None] | None) -> Outcome:
        log.info("maintenance: rolling restart (%s) begins%s", trigger, f": {reason}" if reason else "")
        self.annotator.annotate(f"maintenance: rolling restart begins ({trigger})" + (f": {reason}" if reason
                                else ""), ["maintenance", "rolling_restart", trigger, "begin"])
        outcome = Outcome("aborted", "cancelled")  # what ``then`` hears if the appliance stops meanwhile
        try:
            assert self.rolling is not None  # set by start_rolling_restart; cleared only below
            outcome = await self.rolling.run()
        except Exception as exc:
            outcome = Outcome("failed", f"{type(exc).__name__}: {exc}")
            log.exception("rolling restart failed")
        finally:
            try:
                if then is not None:
                    then(outcome)
            except Exception:
                log.exception("after the rolling restart")
            finally:
                self.rolling = None
        self.record("rolling_restart", trigger, outcome.result, detail=outcome.detail)
        return outcome

    async def _restart(self, replica: Replica, trigger: str, reason: str) -> Outcome:
        try:
            # A hung replica's requests will not finish: waiting out the drain timeout would only delay the fix.
            outcome = await self.procedure.run(replica, drain_seconds=0 if self.is_hung(replica.name) else None)
        except Exception as exc:
            outcome = Outcome("failed", f"{type(exc).__name__}: {exc}")
            log.exception("restart of %s failed", replica.name)
        finally:
            self.restarting.discard(replica.name)
        detail = outcome.detail + (f" ({reason})" if reason else "")
        self._replica_done(replica, Outcome(outcome.result, detail, outcome.restarted), trigger)
        return outcome

    def _replica_done(self, replica: Replica, outcome: Outcome, trigger: str) -> None:
        if outcome.result == "ok":
            self.last_restart[replica.name] = time.time()
        self.record("restart", trigger, outcome.result, replica=replica.name, detail=outcome.detail)

    def _spawn(self, coroutine: Coroutine[Any, Any, Outcome], name: str) -> asyncio.Task[Outcome]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def min_ready_for(self, replica_count: int) -> int:
        """``min_ready_replicas``, capped at replicas - 1 (a single replica may still be restarted)."""
        return max(0, min(self.min_ready, replica_count - 1))

    def _check_capacity(self, replica: Replica, action: str, trigger: str) -> None:
        """BelowMinReady if taking ``replica`` out of routing leaves fewer than the minimum serving;
        LastRoutableReplica if an alert would take the last one."""
        if not self.serving(replica):
            return  # it is not capacity now: acting on it takes none away
        replicas = list(self._replicas())
        needed = self.min_ready_for(len(replicas))
        left = sum(1 for r in replicas if r is not replica and self.serving(r))
        if trigger == "alert" and left == 0:
            raise LastRoutableReplica(f"{action} of {replica.name} refused: it is the last routable replica, and "
                                      "alerts never take that (an operator can, through the admin API)")
        if left < needed:
            raise BelowMinReady(f"{action} of {replica.name} refused: it would leave {left} routable replica(s) "
                                f"(not ejected) and maintenance.min_ready_replicas needs {needed}")

    @staticmethod
    def _check_supervised(replicas: Sequence[Replica]) -> None:
        for replica in replicas:
            if not replica.restartable:
                raise NotSupervised(f"{replica.name} is not supervised by this appliance")


def http_warmer(model: str, prompt: str, max_tokens: int, timeout_seconds: float = 30.0,
                headers: Mapping[str, str] | None = None) -> Callable[[Replica], Awaitable[bool]]:
    """One small completion straight to the replica (it is not routable yet); True on a 200. ``headers``: what
    every request to an engine carries (the engine key, which the engine requires)."""

    async def warm(replica: Replica) -> bool:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as session, \
                    session.post(f"{replica.url}/v1/completions", json=body, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    log.warning("%s: warm-up request answered %d", replica.name, response.status)
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("%s: warm-up request failed: %s", replica.name, exc)
            return False

    return warm
