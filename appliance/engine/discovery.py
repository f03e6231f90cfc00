"""Engines found by DNS: the gateway role's fleet (on Kubernetes, a headless Service's name).

The name is resolved every ``discovery.interval_seconds``. Each address is a node; each node runs
``discovery.engines_per_node`` engines at ``engine_base_port + i``. An engine that appears is a
``DiscoveredReplica``: an ``ExternalReplica`` (the same health-following: STARTING until its /health is green)
named after its address, so a node that comes back at the same address keeps its name (and its metric series).
An engine whose address vanishes leaves routing at once; requests already on it keep their connection and
finish, and a request that cannot connect to it any more is retried on another replica by the proxy (before the
first byte). A resolution that fails (timeout, SERVFAIL) keeps the last known engines: a DNS hiccup must not
empty the fleet; only an answer that the name has no addresses (NXDOMAIN, no records) does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import dns.asyncresolver
import dns.exception
import dns.resolver
from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.engine.external import ExternalReplica
from appliance.engine.settings import DiscoverySettings

log = logging.getLogger(__name__)

Resolve = Callable[[], Awaitable["set[str] | None"]]  # the addresses now; None when the resolution failed


def engine_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def replica_name(address: str, port: int) -> str:
    return f"{address}:{port}"


class DiscoveredReplica(ExternalReplica):
    """An engine at a discovered address: routed to and health-followed like any external engine."""

    def __init__(self, address: str, port: int) -> None:
        super().__init__(0, engine_url(address, port))
        self.name = replica_name(address, port)
        self.address = address


async def resolve_with_nameserver(name: str, nameserver: str, timeout: float) -> set[str] | None:
    """A and AAAA records of ``name`` from one DNS server (``host:port``), bypassing the system's resolver."""
    host, _, port = nameserver.rpartition(":")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host.strip("[]")]
    resolver.port = int(port)
    resolver.lifetime = timeout
    resolver.cache = None
    addresses: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except dns.resolver.NXDOMAIN:
            return set()
        except dns.resolver.NoAnswer:
            continue
        except dns.exception.DNSException as exc:
            log.warning("resolving %s (%s) at %s failed: %s", name, rdtype, nameserver, exc)
            return None
        addresses |= {record.address for record in answer}
    return addresses


NO_SUCH_NAME = {getattr(socket, code) for code in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, code)}


async def resolve_with_system(name: str, timeout: float) -> set[str] | None:
    """The system resolver (cluster DNS in a pod), through the event loop's getaddrinfo."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(name, None, type=socket.SOCK_STREAM), timeout)
    except socket.gaierror as exc:
        if exc.errno in NO_SUCH_NAME:
            return set()
        log.warning("resolving %s failed: %s", name, exc)
        return None
    except (TimeoutError, OSError) as exc:
        log.warning("resolving %s failed: %r", name, exc)
        return None
    return {str(info[4][0]) for info in infos}


def resolver_for(discovery: DiscoverySettings) -> Resolve:
    name, timeout = discovery.name, discovery.resolve_timeout_seconds
    if not name:
        raise ValueError("discovery.name is not set")
    if discovery.nameserver:
        nameserver = discovery.nameserver
        return lambda: resolve_with_nameserver(name, nameserver, timeout)
    return lambda: resolve_with_system(name, timeout)


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.addresses = Gauge("appliance_discovery_addresses", "Node addresses the last good resolution returned",
                               registry=registry)
        self.resolutions = Counter("appliance_discovery_resolutions", "DNS resolutions of discovery.name",
                                   ["result"], registry=registry)
        self.changes = Counter("appliance_discovery_changes", "Engines that joined or left routing by discovery",
                               ["change"], registry=registry)
        for result in ("ok", "failed"):
            self.resolutions.labels(result)
        for change in ("joined", "left"):
            self.changes.labels(change)


class DnsFleet:
    """Satisfies ``appliance.engine.contract.Fleet``: the engines behind a DNS name, followed on an interval."""

    def __init__(self, resolve: Resolve, *, ports: Sequence[int], interval_seconds: float,
                 registry: CollectorRegistry | None = None) -> None:
        self._resolve = resolve
        self._ports = tuple(ports)
        self._interval = interval_seconds
        self._members: dict[str, DiscoveredReplica] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._metrics = DiscoveryMetrics(registry) if registry is not None else None
        self.last_change: float | None = None  # unix time the set of engines last changed

    @classmethod
    def from_discovery(cls, discovery: DiscoverySettings, base_port: int,
                       registry: CollectorRegistry | None = None) -> DnsFleet:
        """The engines behind ``discovery.name``: ``discovery.engines_per_node`` per address, on consecutive ports
        from ``base_port`` (the nodes' ``engine.base_port``, given by whoever composes the settings)."""
        ports = [base_port + i for i in range(discovery.engines_per_node)]
        return cls(resolver_for(discovery), ports=ports, interval_seconds=discovery.interval_seconds,
                   registry=registry)

    @property
    def replicas(self) -> list[DiscoveredReplica]:
        """Ordered by address and port, so that routing's ties break the same way on every gateway."""
        return [self._members[name] for name in sorted(self._members)]

    async def start(self) -> None:
        """Resolve once (a gateway starts with whatever is there), then follow the name in the background."""
        self._session = aiohttp.ClientSession()
        await self.refresh()
        self._task = asyncio.create_task(self._follow(), name="dns-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._members.values()))
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def refresh(self) -> None:
        """One resolution, applied: new addresses join (STARTING), vanished ones leave routing."""
        addresses = await self._resolve()
        if addresses is None:
            self._count_resolution("failed")
            return
        self._count_resolution("ok")
        if self._metrics is not None:
            self._metrics.addresses.set(len(addresses))
        wanted = {replica_name(a, p): (a, p) for a in addresses for p in self._ports}
        joined = [name for name in wanted if name not in self._members]
        left = [name for name in self._members if name not in wanted]
        for name in joined:
            replica = DiscoveredReplica(*wanted[name])
            assert self._session is not None
            replica.start(self._session)
            self._members[name] = replica
            log.info("discovered %s: joins routing once /health is green", replica.url)
        gone = [self._members.pop(name) for name in left]
        for replica in gone:
            log.info("%s vanished from DNS: leaves routing (requests on it finish or fail over)", replica.url)
        await asyncio.gather(*(r.stop() for r in gone))
        if joined or left:
            self.last_change = time.time()
            if self._metrics is not None:
                self._metrics.changes.labels("joined").inc(len(joined))
                self._metrics.changes.labels("left").inc(len(left))

    def _count_resolution(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.resolutions.labels(result).inc()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
            except Exception:  # discovery must never die; the next round tries again
                log.exception("discovery round failed")
