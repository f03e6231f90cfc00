"""Ending a removed tenant's streams: a hook that can cut any request on its way, and ends it with an error event
that says why.

A reload that removes a tenant revokes its keys at once (``Gateway.update_tenants``). Its queued requests are
answered 401 by admission (``Admission.revoke``); its streams are cut here: the stream's slot is given back (as
aborted: the replica did nothing wrong) and its upstream connection closed, so the engine aborts the request; the
relay's read then ends, and this hook, nearest the engine on the response's side, resolves the break before any
other (migration would otherwise continue it elsewhere) with a 401 error event. A stream whose engine has not
answered yet is answered 401 when it does, before any byte; one between two replicas (a continuation waiting for a
slot) is refused by admission when it asks for the next one. Non-streaming answers already
being generated run to their end (bounded by ``gateway.request_timeout_seconds``): cutting them would leave the
client a 502 that says nothing of the revocation.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection

from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.failures import error_event
from appliance.gateway.upstream.hook import Attempt, Break, RequestHook, Resolution, StreamBreak
from appliance.http.auth import revoked_error

REVOKED = "revoked"  # the break's reason


class Revocation:
    """The hook: every stream on its way, by tenant, so that a reload can end a removed tenant's."""

    name = "revocation"

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[RevocableStream] = weakref.WeakSet()

    def start(self, exchange: Exchange) -> RevocableStream | None:
        if not exchange.stream:
            return None
        stream = RevocableStream(exchange)
        self._streams.add(stream)
        return stream

    def revoke(self, tenants: Collection[str]) -> int:
        """Cut the streams of these tenants; returns how many."""
        cut = 0
        for stream in list(self._streams):
            if stream.exchange.tenant.name in tenants and not stream.revoked:
                stream.cut()
                cut += 1
        return cut


class RevocableStream(RequestHook):
    """One stream, cut when its tenant is revoked."""

    __slots__ = ("exchange", "revoked", "__weakref__")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.revoked = False

    def cut(self) -> None:
        """A stream being answered: give back the slot without blaming the replica and close the connection (the
        engine aborts the request, the relay's read ends). One whose engine has not answered yet is refused when
        it does (``responding``); one with no replica is refused by admission."""
        self.revoked = True
        if self.exchange.upstream is not None:
            self.exchange.settle(Outcome.ABORTED)

    def responding(self, attempt: Attempt, headers: dict[str, str]) -> None:
        if self.revoked:  # cut while its request was on its way: no byte of the answer has gone out yet
            raise revoked_error()

    def leg_closed(self) -> None:
        if self.revoked:  # the read ended cleanly because the connection was closed under it
            raise StreamBreak(REVOKED, "the API key was revoked")

    async def broke(self, brk: Break) -> Resolution | None:
        if not self.revoked:
            return None
        error = revoked_error()
        return Resolution(error_event(error, error.message), Outcome.ABORTED, error.status)
