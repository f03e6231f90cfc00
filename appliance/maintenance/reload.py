"""``appliance reload`` / ``POST /admin/reload``: re-read the configuration given at start, apply the tenants and
API keys at once, and roll the replicas onto the new engine settings, one at a time (the rolling restart, so
``min_ready_replicas`` holds).

What applies at once (``HOT_KEYS``): ``tenants``, ``gateway.api_keys`` and the admin, alerts and metrics tokens
(and their ``*_file`` twins) -- the keys, each tenant's priority, weight and quota rates, the credentials --
through the ``hot`` callback the composition root gives (the gateway's tenant directory, quotas and accounting,
and the keyring the credential checks read). No restart: every tenant's quota bucket keeps its level (a tenant in
debt stays in debt, removed and added back too). A replaced secret (a token, a tenant's key) stays accepted for
``gateway.secret_overlap_seconds``, then is refused, so that whoever holds it can move to the new one; a removed
tenant's keys are revoked at once and its queued and streaming requests ended.

What can roll: the ``engine`` section's vLLM settings (its flags, its environment, its timeouts), because each
replica's command line is rebuilt from them at its next start (``Reconfigurable.stage`` takes the new section). What
cannot: anything else the running gateway, collectors or maintenance were built from at start (the gateway section:
ports, host, timeouts; replica count, model, served name, routing, admission, maintenance ...),
the engine section's ``NOT_ROLLABLE_ENGINE_KEYS`` (where engines listen and log, and the supervisor's crash backoff,
fixed when the fleet was built), and ``engine.tensor_parallel_size`` (it changes which devices a replica holds, and
replicas restarted one at a time would overlap the ones not yet restarted). A reload that changes any of
those is refused as a whole, with the keys listed, and nothing changes: restart the appliance for them. A reload
that changes engine settings while a restart is in progress is refused as a whole too (nothing changes); one that
changes only tenants and keys applies at once.

A reload whose rolling restart stops (a replica not back in time, too few routable replicas, the appliance
stopping) is undone: it unstages what it staged, so no later crash restart or admin restart starts an engine on
the settings the roll stopped on, and the running configuration it compares the next reload with is the previous
one again (with the tenants and keys it applied, which stay applied). A replica the roll already moved keeps its
engine until its next start, then starts on the previous settings.

The configuration is re-read from the same file and explicit overrides as at start, with the environment of the
running process. Values the start command filled in itself (``appliance up``: the demo model, the generated
admin token) are kept as long as the file still leaves them as it did at start.

The configuration is the appliance's whole settings object, which composes maintenance's own section: this module
names what it reads of it (``Configuration``) instead of importing it, and is given the function that reads it
again (``load``) by the composition layer (appliance.composition.maintenance).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

from appliance.engine.settings import EngineSettings
from appliance.maintenance.controller import MaintenanceController
from appliance.maintenance.errors import MaintenanceBusy, MaintenanceError
from appliance.maintenance.rolling import Outcome

log = logging.getLogger(__name__)

NOT_ROLLABLE_ENGINE_KEYS = frozenset({
    "engine.tensor_parallel_size", "engine.base_port", "engine.host", "engine.advertise_host", "engine.log_max_bytes",
    "engine.log_backups", "engine.log_stdout", "engine.restart_backoff_initial_seconds",
    "engine.restart_backoff_max_seconds", "engine.user",  # the user is checked once, at start (secrets, model)
    # The gateway subscribed to the engines' KV events where these said, at start (precise prefix routing).
    "engine.kv_events", "engine.kv_events_port_offset", "engine.kv_events_replay_port_offset",
})
# Applied at once, without a restart: the tenants and every credential (a replaced secret stays valid for
# gateway.secret_overlap_seconds, so its holders can move over; appliance.http.credentials.Keyring).
HOT_KEYS = ("tenants", "gateway.api_keys", "gateway.api_keys_file", "gateway.admin_token",
            "gateway.admin_token_file", "gateway.alerts_token", "gateway.alerts_token_file", "gateway.metrics_token",
            "gateway.metrics_token_file", "gateway.lease_token", "gateway.lease_token_file",
            "gateway.secret_overlap_seconds")


class ReloadUnavailable(MaintenanceError):
    code = "reload_unavailable"


class ReloadRefused(MaintenanceError):
    code = "reload_refused"


class InvalidConfig(MaintenanceError):
    code = "invalid_config"


class Configuration(Protocol):
    """What a reload reads of the appliance's configuration (``appliance.settings.Settings`` is one)."""

    @property
    def engine(self) -> EngineSettings:
        """The section a reload rolls onto the replicas."""
        ...

    def value_at(self, key: str) -> Any:
        """The value of a top-level key or of a ``section.key``."""
        ...

    def replaced(self, values: Mapping[str, Any]) -> Self:
        """A copy with each key (top-level or ``section.key``) set to its value."""
        ...

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]:
        """Every top-level key with its value, a section as a mapping of its keys (pydantic's dump)."""
        ...


C = TypeVar("C", bound=Configuration)


@dataclass(frozen=True)
class ReloadResult:
    changed: list[str]  # dotted keys (values are not echoed: extra_args may hold secrets)
    rolling_restart: bool

    def as_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "rolling_restart": self.rolling_restart}


def changed_keys(old: Configuration, new: Configuration) -> list[str]:
    """Dotted names of the settings that differ (one level into sections: ``engine.max_num_seqs``)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    keys: list[str] = []
    for key in sorted(a.keys() | b.keys()):
        before, after = a.get(key), b.get(key)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            subs = sorted(before.keys() | after.keys())
            keys += [f"{key}.{sub}" for sub in subs if before.get(sub) != after.get(sub)]
        else:
            keys.append(key)
    return keys


def dotted_keys(settings: Configuration) -> list[str]:
    """Every key, one level into sections (``engine.max_num_seqs``), as ``changed_keys`` names them."""
    keys: list[str] = []
    for name, value in settings.model_dump().items():
        keys += [f"{name}.{sub}" for sub in value] if isinstance(value, dict) else [name]
    return keys


def rollable(key: str) -> bool:
    return key.startswith("engine.") and key not in NOT_ROLLABLE_ENGINE_KEYS


class ConfigReloader(Generic[C]):
    def __init__(self, settings: C, controller: MaintenanceController,
                 stage: Callable[[EngineSettings], None] | None, unstage: Callable[[], None] | None = None,
                 hot: Callable[[C], None] | None = None, *, load: Callable[[], C] | None = None) -> None:
        """``stage``/``unstage``: the fleet's ``Reconfigurable`` methods; None when the appliance does not run its
        engines (a reload then is unavailable: it could not be undone). ``hot``: applies the ``HOT_KEYS`` of a new
        configuration to the running appliance (set by the composition root; None: they are refused like any
        other key). ``load``: reads the configuration again from where ``settings`` came from, raising ValueError
        (``appliance.settings.ConfigError``) when it does not validate; None: it was built in code, and a reload is
        unavailable."""
        self.hot = hot
        self.current = settings
        self._controller = controller
        self._stage = stage
        self._unstage = unstage
        self._load = load
        self._start_fills = self._fills_at_start(settings, load)

    def reload(self) -> ReloadResult:
        """Validate and start the roll; raises ReloadUnavailable, InvalidConfig, ReloadRefused, MaintenanceBusy."""
        load = self._load
        if load is None or self._stage is None or self._unstage is None:
            raise ReloadUnavailable("reload needs an appliance that runs its own engines and was started from a "
                                    "configuration (file and environment) it can read again")
        try:
            new = self._with_start_fills(load())
        except ValueError as exc:
            raise InvalidConfig(f"the configuration does not validate, nothing changed: {exc}") from None
        changed = changed_keys(self.current, new)
        if not changed:
            return ReloadResult([], False)
        hot = [key for key in changed if key in HOT_KEYS and self.hot is not None]
        blocked = [key for key in changed if not rollable(key) and key not in hot]
        if blocked:
            raise ReloadRefused(f"cannot roll {', '.join(blocked)} onto running replicas (only engine.* settings "
                                f"roll, except {', '.join(sorted(NOT_ROLLABLE_ENGINE_KEYS))}; tenants, "
                                "gateway.api_keys and the gateway's tokens apply at once); restart the appliance for "
                                "these. Nothing changed.")
        rolling = len(hot) < len(changed)
        if rolling and self._controller.busy:
            raise MaintenanceBusy("a restart is in progress; reload again when it is done")
        if hot:
            self._apply_hot(new, hot)
        if not rolling:
            return ReloadResult(changed, False)
        previous = self.current
        self._stage(new.engine)
        self.current = previous.replaced({"engine": new.engine})
        reason = "reload: " + ", ".join(changed)
        log.info("maintenance: %s; rolling the replicas onto it", reason)
        try:
            self._controller.start_rolling_restart("admin", reason,
                                                   then=lambda outcome: self._roll_ended(outcome, previous))
        except MaintenanceError:
            self._undo(previous, "the rolling restart did not start")
            raise
        return ReloadResult(changed, True)

    def _apply_hot(self, new: C, keys: list[str]) -> None:
        assert self.hot is not None
        self.hot(new)
        self.current = self.current.replaced({key: new.value_at(key) for key in HOT_KEYS})
        log.info("maintenance: reload applied %s at once", ", ".join(keys))

    def _roll_ended(self, outcome: Outcome, previous: C) -> None:
        if outcome.result != "ok":
            self._undo(previous, f"the rolling restart ended {outcome.result}: {outcome.detail}")

    def _undo(self, previous: C, why: str) -> None:
        """Unstage, and make the previous configuration the running one again."""
        assert self._unstage is not None
        self._unstage()
        self.current = previous
        log.warning("maintenance: reload stopped (%s); its engine settings are unstaged: replicas start on the "
                    "previous ones", why)

    # -- values the start command set itself ------------------------------------------------------------------

    @staticmethod
    def _fills_at_start(settings: C, load: Callable[[], C] | None) -> dict[str, tuple[Any, Any]]:
        """Key (top-level, or one level into a section: ``gateway.admin_token``) -> (what the source gave at start,
        what the appliance runs with) where they differ."""
        if load is None:
            return {}
        try:
            loaded = load()
        except ValueError:
            return {}
        return {key: (loaded.value_at(key), settings.value_at(key)) for key in dotted_keys(settings)
                if loaded.value_at(key) != settings.value_at(key)}

    def _with_start_fills(self, new: C) -> C:
        keep = {key: running for key, (given, running) in self._start_fills.items() if new.value_at(key) == given}
        return new.replaced(keep) if keep else new
