"""Hostile input is refused before any work: the key is checked before the body is read, a body that
stalls is cut at the read timeout, bodies in flight share one byte budget, and the connection cap, the header
timeout and the header size hold at the connection. Every refusal is OpenAI error JSON, never a 500 or a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import socket
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.serve import server_options
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.live import LiveGateway, wait_until

KEY = {"authorization": "Bearer k1"}


def build(**overrides):
    return create_app(Settings(served_model_name="demo", **overrides), replicas=lambda: [FakeReplica("replica-0")],
                      registry=CollectorRegistry())


class Exchange:
    """One request straight into the ASGI app, its body fed by the test: the chunks, then (unless ``ends``) a
    client that never sends the rest."""

    def __init__(self, path: str, headers: dict[str, str], chunks: list[bytes] = (), ends: bool = False) -> None:
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                      "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                      "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
                      "headers": [(k.encode(), v.encode()) for k, v in
                                  {"content-type": "application/json", **headers}.items()]}
        self.chunks = list(chunks)
        self.ends = ends
        self.reads = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.reads += 1
        if self.chunks:
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": not (self.ends and not self.chunks)}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def run(self, app, timeout: float = 10.0) -> Exchange:
        await asyncio.wait_for(app(self.scope, self.receive, self.send), timeout)
        return self

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    @property
    def error(self) -> dict:
        body = b"".join(m.get("body", b"") for m in self.sent[1:])
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error


def test_no_key_and_invalid_json_is_a_401_not_a_400():
    app = build(api_keys=["k1"])
    exchange = asyncio.run(Exchange("/v1/completions", {"content-length": "9"}, [b"{not json"], ends=True).run(app))
    assert exchange.status == 401
    assert exchange.error["code"] == "invalid_api_key"
    assert exchange.headers["www-authenticate"] == "Bearer"


def test_no_key_and_a_body_that_never_ends_is_a_401_without_reading_it():
    app = build(api_keys=["k1"], admin_token="t0ken")
    for path, headers in (("/v1/chat/completions", {}), ("/v1/completions", {"authorization": "Bearer wrong"}),
                          ("/admin/alerts", KEY), ("/maintenance/lease", KEY)):
        exchange = asyncio.run(Exchange(path, {"content-length": "1000000", **headers}, [b"x" * 1000]).run(app))
        assert exchange.status == 401, path
        assert exchange.reads == 0, path  # answered from the headers alone
        assert exchange.error["code"] in ("invalid_api_key", "invalid_admin_token", "invalid_lease_token")


def test_admin_routes_stay_403_when_the_admin_api_is_off():
    app = build()
    exchange = asyncio.run(Exchange("/admin/alerts", {"content-length": "1000000", **KEY}, [b"x"]).run(app))
    assert exchange.status == 403 and exchange.reads == 0


def test_a_body_that_stalls_is_a_408_within_the_read_timeout():
    app = build(api_keys=["k1"], intake={"body_timeout_seconds": 0.5})
    started = time.monotonic()
    exchange = asyncio.run(Exchange("/v1/completions", {"content-length": "1000", **KEY}, [b'{"prompt": "']).run(app))
    assert exchange.status == 408
    assert exchange.error["code"] == "body_timeout"
    assert time.monotonic() - started < 5  # 0.5 s, generously
    assert context_of(app).body_budget.in_flight == 0


def test_bodies_in_flight_share_one_byte_budget():
    app = build(api_keys=["k1"], max_request_bytes=4096,
                intake={"body_budget_bytes": 8192, "body_timeout_seconds": 1.0})
    budget = context_of(app).body_budget

    async def scenario() -> None:
        holders = [asyncio.ensure_future(Exchange("/v1/completions", {"content-length": "4096", **KEY},
                                                  [b"x" * 100]).run(app)) for _ in range(2)]
        assert await asyncio.to_thread(wait_until, lambda: budget.in_flight == 8192, 5)
        over = await Exchange("/v1/completions", {"content-length": "4096", **KEY}, [b"x"]).run(app)
        assert over.status == 503 and over.reads == 0  # refused from the declared length, nothing read
        assert int(over.headers["retry-after"]) >= 1
        assert over.error["code"] == "body_budget_exhausted"
        chunked = await Exchange("/v1/completions", KEY, [b"x" * 100]).run(app)  # no length: counted as it comes
        assert chunked.status == 503 and chunked.error["code"] == "body_budget_exhausted"
        assert [h.status for h in await asyncio.gather(*holders)] == [408, 408]
        assert budget.in_flight == 0  # given back when the stalled bodies were cut
        body = b'{"prompt": 5}'
        after = await Exchange("/v1/completions", {"content-length": str(len(body)), **KEY}, [body], ends=True).run(app)
        assert after.status == 400  # admitted again: validated, not refused
        assert budget.in_flight == 0

    asyncio.run(scenario())


def test_the_budget_must_hold_the_largest_body():
    with pytest.raises(ValueError, match="body_budget_bytes"):
        Settings(max_request_bytes=4096, intake={"body_budget_bytes": 2048})


# A real uvicorn, configured as `appliance serve` configures it: the connection-level limits live there.


def live(settings: Settings) -> LiveGateway:
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0")], registry=CollectorRegistry())
    return LiveGateway(app, **server_options(settings))


def read_answer(sock: socket.socket, timeout: float = 20.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (or the timeout): the bytes, and whether it closed."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return data, True
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        return data, False


def one_more_connection(gateway, held: int) -> tuple[bytes, bool]:
    """Once the gateway holds ``held`` connections, one more from this address asks for /health/live: its answer
    and whether the gateway closed it."""
    assert wait_until(lambda: len(gateway.server.server_state.connections) == held)
    with socket.create_connection(("127.0.0.1", gateway.port)) as extra:
        extra.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\n\r\n")
        return read_answer(extra)


def test_connections_beyond_the_cap_get_a_503_with_retry_after():
    with live(Settings(served_model_name="demo", intake={"max_connections": 2})) as gateway:
        idle = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(2)]
        try:
            answer, closed = one_more_connection(gateway, held=2)
            assert answer.startswith(b"HTTP/1.1 503 ") and closed
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"retry-after: " in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: not gateway.server.server_state.connections)
        assert httpx.get(f"{gateway.url}/health/live", timeout=10).status_code == 200


def test_one_client_cannot_take_every_connection():
    """The connection cap comes before authentication: without a per-client bound, one client's idle keep-alive
    connections locked everyone else out. Its connections beyond intake.max_connections_per_client get a 503,
    and another client (another address) is still served."""
    settings = Settings(served_model_name="demo", intake={"max_connections": 100, "max_connections_per_client": 2})
    with live(settings) as gateway:
        idle = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(2)]
        try:
            answer, closed = one_more_connection(gateway, held=2)
            assert answer.startswith(b"HTTP/1.1 503 ") and closed
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"retry-after: " in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_client_connections"
            with socket.create_connection(("127.0.0.1", gateway.port), source_address=("127.0.0.2", 0)) as other:
                other.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n")
                answer, _ = read_answer(other)
            assert answer.startswith(b"HTTP/1.1 200 ")
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: not gateway.server.server_state.connections)
        assert httpx.get(f"{gateway.url}/health/live", timeout=10).status_code == 200
        protocol = gateway.server.config.http
        assert wait_until(lambda: not protocol.per_client)  # every connection counted was uncounted


def test_headers_that_never_end_are_a_408_within_the_header_timeout():
    with live(Settings(served_model_name="demo", intake={"header_timeout_seconds": 0.5})) as gateway:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", gateway.port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\nx-slow: ")
            answer, closed = read_answer(slow)
        assert answer.startswith(b"HTTP/1.1 408 ") and closed
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "header_timeout"
        with socket.create_connection(("127.0.0.1", gateway.port)) as silent:  # connects, never says a word
            _, closed = read_answer(silent)
        assert closed
        assert time.monotonic() - started < 15


def test_headers_over_the_limit_are_a_431():
    with live(Settings(served_model_name="demo", intake={"max_header_bytes": 2048})) as gateway:
        with socket.create_connection(("127.0.0.1", gateway.port)) as big:
            big.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\nx-big: " + b"a" * 4096)
            answer, closed = read_answer(big)
        assert answer.startswith(b"HTTP/1.1 431 ") and closed
        assert httpx.get(f"{gateway.url}/health/live", headers={"x-small": "a" * 512}, timeout=10).status_code == 200


def test_an_answer_given_before_the_body_ended_closes_the_connection():
    """A route that never reads its body (here /health/live) answers; the rest of the body is not read, even when
    it keeps trickling in (which stops uvicorn's keep-alive timer from ever firing)."""
    with live(Settings(served_model_name="demo")) as gateway, \
            socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\ncontent-length: 1000000\r\n\r\n"
                     + b"x" * 1000)
        sock.settimeout(0.3)
        answer, closed, deadline = b"", False, time.monotonic() + 20
        while not closed and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
                answer, closed = answer + chunk, not chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
            if not closed:
                try:
                    sock.sendall(b"x")
                except OSError:
                    closed = True
        assert answer.startswith(b"HTTP/1.1 200 ") and closed
        # and the server let go of it (uvicorn's keep-alive timeout, 5 s, no longer restarted by the trickle)
        assert wait_until(lambda: not gateway.server.server_state.connections, timeout=20)


def test_150_stalled_unauthenticated_bodies_are_answered_or_closed_and_the_gateway_still_serves():
    connections, body_timeout = 150, 2.0
    settings = Settings(served_model_name="demo", api_keys=["k1"], intake={"body_timeout_seconds": body_timeout})
    with live(settings) as gateway:
        sockets = []
        for _ in range(connections):
            sock = socket.create_connection(("127.0.0.1", gateway.port))
            sock.settimeout(10)
            with contextlib.suppress(OSError):  # already answered and closed: read below
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: "
                             b"application/json\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 65536)
            sockets.append(sock)
        outcomes: dict[str, int] = {"401": 0, "closed": 0, "other": 0}
        with selectors.DefaultSelector() as selector:
            for sock in sockets:
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            deadline = time.monotonic() + body_timeout + 30  # generous: a loaded 2-core machine
            while selector.get_map() and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=0.5):
                    try:
                        first = key.fileobj.recv(65536)
                    except OSError:
                        first = b""
                    outcome = "closed" if not first else "401" if first.startswith(b"HTTP/1.1 401 ") else "other"
                    outcomes[outcome] += 1
                    selector.unregister(key.fileobj)
            hung = len(selector.get_map())
        assert hung == 0, f"{hung} of {connections} connections neither answered nor closed ({outcomes})"
        # the server let go of them while the clients still held theirs open
        assert wait_until(lambda: not gateway.server.server_state.connections, timeout=30)
        for sock in sockets:
            sock.close()
        assert outcomes["other"] == 0, outcomes
        assert outcomes["401"] > 0, outcomes
        assert httpx.get(f"{gateway.url}/v1/models", headers=KEY, timeout=10).status_code == 200
