"""How the gateway names a replica to clients (``x-appliance-replica``, error texts, ``/health/ready``).

A replica's own name is what operators see (metrics, ``appliance status``, request records), and for an engine
found by DNS it is its address (``10.42.0.17:8100``, appliance/engine/discovery.py): an internal address that a
client has no business learning. Names that are already opaque (``replica-0`` of a local fleet, ``external-1`` of
``discovery.engine_urls``) are shown as they are; any other is shown as ``replica-`` and a keyed hash of it. The
key is random per process, so the label cannot be reversed by hashing the few addresses a pod network has; it is
stable while the gateway runs (one replica, one label), and an operator finds the replica behind a label from the
request's record (``appliance requests --id``, the client's ``x-request-id``)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets

_OPAQUE = re.compile(r"(?:replica|external)-\d+")
_KEY = secrets.token_bytes(32)


@functools.lru_cache(maxsize=4096)
def client_label(name: str) -> str:
    """The label clients see for the replica named ``name``."""
    if _OPAQUE.fullmatch(name):
        return name
    return "replica-" + hmac.new(_KEY, name.encode(), hashlib.sha256).hexdigest()[:12]
