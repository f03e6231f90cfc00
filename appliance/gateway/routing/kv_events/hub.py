"""The gateway's subscriptions to its replicas' KV-cache events: one per replica it routes to, started with the app.

Which replicas publish, and where, is the composition root's to say (``endpoints``: the replica's URL host and its
port plus the configured offsets, or None). Replicas come and go (a reload, discovery); the hub follows them every
second and whenever the router looks (``observe``, before each decision). A replica whose engine is another process
now (its status: starts, restarts, start time, pid) or whose engine's cache is gone (starting, stopped, in backoff,
unhealthy) has its index emptied at that moment, before it is scored again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence

import zmq.asyncio

from appliance.engine.contract import Replica, ReplicaState
from appliance.gateway.routing.kv_events.index import ReplicaIndex
from appliance.gateway.routing.kv_events.settings import PrefixCacheSettings
from appliance.gateway.routing.kv_events.subscriber import EventEndpoints, Subscription
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer

log = logging.getLogger(__name__)

RECONCILE_SECONDS = 1.0
# States in which the engine's cache is gone or about to be (a drain keeps it): as the approximate scorer's.
_CACHE_LOST = frozenset({ReplicaState.STARTING, ReplicaState.UNHEALTHY, ReplicaState.BACKOFF,
                         ReplicaState.STOPPING, ReplicaState.STOPPED})

Life = tuple[int, int, float | None, int | None]


class KvEventsHub:
    def __init__(self, settings: PrefixCacheSettings, endpoints: Callable[[Replica], EventEndpoints | None],
                 replicas: Callable[[], Sequence[Replica]], *, tokenizer: PromptTokenizer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``tokenizer``: the prompt tokenizer's threads, which the hub stops with its subscriptions."""
        self.settings = settings
        self.tokenizer = tokenizer
        self._endpoints = endpoints
        self._replicas = replicas
        self._clock = clock
        self.indexes: dict[str, ReplicaIndex] = {}
        self.subscriptions: dict[str, Subscription] = {}
        self._lives: dict[str, Life] = {}
        self._context: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Subscribe to every replica now and follow the fleet (on the running event loop)."""
        self._context = zmq.asyncio.Context()
        self.observe(self._replicas())
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="kv-events-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for subscription in list(self.subscriptions.values()):
            await subscription.stop()
        self.subscriptions.clear()
        if self._context is not None:
            self._context.term()
            self._context = None
        if self.tokenizer is not None:
            self.tokenizer.close()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_SECONDS)
            try:
                replicas = self._replicas()
                self.observe(replicas)
                self.prune({r.name for r in replicas})
            except Exception:  # never let the follower die: the indexes would stop following restarts
                log.exception("KV event subscriptions: following the fleet failed")

    # -- what the router tells ---------------------------------------------------------------------------------

    def observe(self, replicas: Sequence[Replica]) -> None:
        """Every replica, before each decision: restarts empty their index; new replicas get a subscription."""
        for replica in replicas:
            self._follow_life(replica)
            if replica.name not in self.subscriptions and self._context is not None:
                self._subscribe(replica)

    def prune(self, live: Collection[str]) -> None:
        """Replicas gone from the fleet: their subscription ends, their index goes."""
        for name in [name for name in self.indexes if name not in live]:
            del self.indexes[name]
            self._lives.pop(name, None)
            subscription = self.subscriptions.pop(name, None)
            if subscription is not None:  # only ever started on the running loop
                asyncio.get_running_loop().create_task(subscription.stop())

    def _follow_life(self, replica: Replica) -> None:
        status = replica.status
        life = (status.starts, status.restarts, status.last_start_time, status.pid)
        known = self._lives.get(replica.name)
        lost = status.state in _CACHE_LOST
        if (known is not None and known != life) or (lost and known is not None):
            subscription = self.subscriptions.get(replica.name)
            if subscription is not None:
                subscription.restarted()
            elif replica.name in self.indexes:
                self.indexes[replica.name].reset("restart")
        if lost:
            self._lives.pop(replica.name, None)
        else:
            self._lives[replica.name] = life

    def _subscribe(self, replica: Replica) -> None:
        endpoints = self._endpoints(replica)
        if endpoints is None:
            return
        assert self._context is not None
        index = self.indexes.setdefault(replica.name, ReplicaIndex(self.settings.index_max_blocks))
        subscription = Subscription(replica.name, endpoints, index, self._context,
                                    replay_timeout_seconds=self.settings.replay_timeout_seconds,
                                    resync_seconds=self.settings.resync_seconds, clock=self._clock)
        self.subscriptions[replica.name] = subscription
        subscription.start()
        log.info("%s: subscribed to KV events at %s (replay %s)", replica.name, endpoints.events, endpoints.replay)

    # -- what the scorer asks ----------------------------------------------------------------------------------

    def usable(self, name: str) -> ReplicaIndex | None:
        """The replica's index when it may be routed on now, else None (unknown)."""
        index = self.indexes.get(name)
        return index if index is not None and index.usable(self._clock()) else None

    def any_usable(self) -> bool:
        now = self._clock()
        return any(index.usable(now) for index in self.indexes.values())

    def block_sizes(self) -> set[int]:
        """The KV block sizes the engines reported (a prompt's block keys are computed at each)."""
        return {index.block_size for index in self.indexes.values() if index.block_size is not None}
