"""The decider's pool of worker processes (``appliance.gateway.workers.pool``), on real worker processes and the
fake engine: its stop is bounded however a worker behaves, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from appliance.app import create_app
from appliance.gateway.workers import messages as m
from appliance.gateway.workers.metrics import MergedRegistry
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import FakeEngine
from tests.gateway.live import LiveWorkers

BOUND = 4.0  # the pool's stop bound in this test (shortened from pool.STOP_SECONDS)
MARGIN = 5.0  # what the decider's own shutdown adds, on a busy test machine


def test_a_worker_that_stops_reading_its_link_does_not_hold_the_deciders_stop() -> None:
    """A worker SIGSTOPped with more queued on its link than the socket holds: closing its link would wait for a
    drain that never comes. The decider's stop still ends within the bound, the wedged worker is killed and reaped,
    and the other one stops on its own."""
    engine = FakeEngine(tokens=5).start()
    settings = Settings(served_model_name="demo", gateway={"workers": 2})
    app = create_app(settings, replicas=lambda: [FakeReplica("replica-0", engine.url)], registry=MergedRegistry())
    try:
        with LiveWorkers(app, settings) as live:
            pool = live.server._workers
            pool.stop_seconds = BOUND
            wedged, healthy = pool.processes[1], pool.processes[2]
            os.kill(wedged.pid, signal.SIGSTOP)
            try:
                session = next(session for session in pool.decider.sessions if session.worker == 1)
                session.link.send(m.Reload(bytes(8 * 2**20)))  # past the socket's buffer and the writer's limit
                time.sleep(0.3)  # the frame went out (in part) on the decider's loop
                started = time.monotonic()
                live.server.should_exit = True
                live._thread.join(BOUND + MARGIN)
                took = time.monotonic() - started
                ended = f"stop took {took:.1f}s; wedged {wedged.returncode}, healthy {healthy.returncode}"
                assert not live._thread.is_alive(), f"the decider's stop still waits after {took:.1f}s"
                assert wedged.returncode == -signal.SIGKILL, ended
                assert healthy.returncode == 0, ended  # it stopped on its own, within the bound: not killed
                assert not Path(f"/proc/{wedged.pid}").exists()  # reaped: not even a zombie
                assert not pool.alive()
            finally:
                if wedged.poll() is None:
                    wedged.kill()
                    wedged.wait(10)
    finally:
        engine.stop()
