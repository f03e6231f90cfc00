"""What crosses the decider's socket: one tagged struct per message (msgspec, msgpack on the wire).

A worker asks (``Acquire``, ``Reserve``) with a number the answer carries back; everything else is one-way: a
worker tells the decider what happened (``Release``, ``Settle``, ``Charge``, ``Relayed``...) and the decider
tells the workers what changed (``Fleet``, ``Reload``, ``Drain``, ``Cut``). The structs carry only plain values:
replicas by name, tenants by value, outcomes by name.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.gateway.routing.request import Decision
from appliance.gateway.tenants.directory import Tenant

# -- worker -> decider: questions (answered by number) -----------------------------------------------------------


class Acquire(msgspec.Struct, tag=True, array_like=True):
    """A slot for one attempt: the router's input (prompt, cache salt, token ids when precise routing tokenized
    it) and whose request it is. ``background``: batch work (idle capacity only)."""

    id: int
    tenant: Tenant
    exclude: list[str]
    prompt: str
    salt: str = ""
    token_ids: list[int] | None = None
    token_salt: str | None = None
    background: bool = False


class Reserve(msgspec.Struct, tag=True, array_like=True):
    """The request's worst case reserved in its tenant's quota buckets."""

    id: int
    tenant: Tenant
    prompt: int
    completion: int
    requests: int


# -- decider -> worker: answers -----------------------------------------------------------------------------------


class Granted(msgspec.Struct, tag=True, array_like=True):
    """A lease on ``replica``'s slot; ``over_share``: the tenant's fair-share standing as the slot was given."""

    id: int
    lease: int
    replica: str
    over_share: bool
    decision: Decision | None = None


class Refused(msgspec.Struct, tag=True, array_like=True):
    """The decision is an error for the client (the APIError the decider raised, as it would have answered)."""

    id: int
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = {}


class Reserved(msgspec.Struct, tag=True, array_like=True):
    """A quota reservation held by the decider (``reservation`` 0: the tenant has no quota to hold)."""

    id: int
    reservation: int


class QuotaRefused(msgspec.Struct, tag=True, array_like=True):
    """The quota refused the request: the decider's ``Refusal``, field by field."""

    id: int
    tenant: str
    limit: str
    per_minute: int
    retry_after: int
    needed: int
    never: bool


# -- worker -> decider: news ----------------------------------------------------------------------------------


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """The client of a queued ``Acquire`` left: it leaves the queue (a slot given meanwhile goes back)."""

    id: int


class Release(msgspec.Struct, tag=True, array_like=True):
    lease: int
    outcome: str
    ttft_seconds: float | None = None


class Reclaimed(msgspec.Struct, tag=True, array_like=True):
    """A worker's lease was dropped without being released (the garbage collector's backstop gives it back next):
    the decider's ledger counts it, as it counts its own (``appliance_slot_leases_reclaimed_total``)."""

    lease: int


class FirstToken(msgspec.Struct, tag=True, array_like=True):
    """The engine's first token for a lease came back (``Lease.first_token``: admission's prefill count)."""

    lease: int


class Settle(msgspec.Struct, tag=True, array_like=True):
    """A reservation settled to what the request used, or refunded whole (``used`` None)."""

    reservation: int
    used: float | None


class Charge(msgspec.Struct, tag=True, array_like=True):
    """Tokens a tenant used, for its fair share (``Admission.charge``)."""

    tenant: Tenant
    tokens: int


class Charged(msgspec.Struct, tag=True, array_like=True):
    """Tokens charged for work on ``replica``, for the reconciliation with the engines' own counters."""

    replica: str
    prompt: int
    completion: int
    finished: int = 0  # sequences among them the engine finished


class Unseen(msgspec.Struct, tag=True, array_like=True):
    """Work on ``replica`` no engine reported, as the worker estimated it, for the decider to charge ``tenant``."""

    replica: str
    tenant: str
    n: int
    prompt: int
    completion: int
    room: int


class Relayed(msgspec.Struct, tag=True, array_like=True):
    """Replicas whose bytes the worker relayed since its last word (progress, for the hung-replica checks)."""

    replicas: list[str]


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    replica: str


class Record(msgspec.Struct, tag=True, array_like=True):
    """A finished request's record (``RequestRecord``), encoded by the worker."""

    record: msgspec.Raw


class Join(msgspec.Struct, tag=True, array_like=True):
    """A worker's first word: its number (the decider answers ``Hello`` and the fleet)."""

    worker: int


class Metrics(msgspec.Struct, tag=True, array_like=True):
    """The worker's registry, collected (``appliance.gateway.workers.metrics.snapshot``)."""

    families: bytes


class Open(msgspec.Struct, tag=True, array_like=True):
    """The worker's requests forwarded and not answered in full (what a drain waits for)."""

    count: int


# -- decider -> worker: news ----------------------------------------------------------------------------------


class ReplicaView(msgspec.Struct, array_like=True):
    """A replica as a worker needs it: where it is, whether it is routable, eligible now, being drained or
    restarted, and the scheduling policy its engine reported."""

    name: str
    url: str
    routable: bool
    eligible: bool
    state: str
    planned_restart: bool
    scheduling_policy: str | None = None


class Fleet(msgspec.Struct, tag=True, array_like=True):
    """The replicas; with precise prefix routing, whether any engine's event index is current (a worker tokenizes
    prompts only then) and the KV block sizes the engines reported (the block keys a worker computes)."""

    replicas: list[ReplicaView]
    kv_usable: bool = False
    block_sizes: list[int] = []


class Reload(msgspec.Struct, tag=True, array_like=True):
    """The hot part of a reloaded configuration (``appliance.maintenance.reload.HOT_KEYS``), pickled settings."""

    settings: bytes


class Drain(msgspec.Struct, tag=True, array_like=True):
    """The appliance drains: new requests get 503."""


class Cut(msgspec.Struct, tag=True, array_like=True):
    """The drain timed out: end the streams still running with the shutting_down event."""


class Hello(msgspec.Struct, tag=True, array_like=True):
    """The decider's answer to ``Join``: the settings the appliance runs with (pickled: secrets included, on a
    socket only the appliance's user can open)."""

    settings: bytes


ToDecider = (Join | Acquire | Reserve | Cancel | Release | Reclaimed | FirstToken | Settle | Charge | Charged | Unseen
             | Relayed | EngineFailed | Record | Open | Metrics)
ToWorker = Granted | Refused | Reserved | QuotaRefused | Fleet | Reload | Drain | Cut | Hello

to_decider: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ToDecider)
to_worker: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ToWorker)
