"""`appliance serve`'s drain: queued requests are waited for like in-flight ones, and streams still running at
the drain timeout end with an error event, not a silent cut."""

import asyncio
import json
import signal
import threading

import httpx
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.context import context_of
from appliance.gateway.routing.router import Outcome
from appliance.serve import DrainingServer, in_flight
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.gateway.live import LiveGateway, wait_until


def test_queued_requests_count_as_pending_for_the_drain():
    app = create_app(Settings(served_model_name="demo", admission={"max_limit": 1}),
                     replicas=lambda: [FakeReplica("replica-0")], registry=CollectorRegistry())
    admission = context_of(app).gateway.admission

    async def scenario() -> int:
        held = await admission.acquire()
        waiter = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0.01)
        pending = in_flight(app)
        held.release(Outcome.SUCCESS)
        waiter.cancel()
        return pending

    assert asyncio.run(scenario()) == 2  # one at the replica, one queued in the gateway


def test_streams_cut_by_the_drain_timeout_end_with_an_error_event(stubs):
    for stub in stubs:
        stub.stall_seconds = 6.0  # the stream stays open long past the drain timeout
    fleet = [FakeReplica(f"replica-{i}", stub.url) for i, stub in enumerate(stubs)]
    app = create_app(Settings(served_model_name="demo"), replicas=lambda: fleet, registry=CollectorRegistry())
    live = LiveGateway(app, lambda config: DrainingServer(config, app, drain_timeout=0.5),
                       timeout_graceful_shutdown=5)
    events: list[str] = []
    with live:
        def read_stream() -> None:
            with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                              json={"prompt": "hi", "stream": True}) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert wait_until(lambda: context_of(app).gateway.router.in_flight() == 1)
        live.server.handle_exit(signal.SIGTERM, None)
        reader.join(20)
        assert wait_until(lambda: not live._thread.is_alive(), timeout=20)
    assert json.loads(events[0][6:])["choices"][0]["text"] == "0"
    assert json.loads(events[-1][6:])["error"]["code"] == "shutting_down"
