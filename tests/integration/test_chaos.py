"""Chaos on 2 real vLLM replicas under steady streaming load, with the real Prometheus and Alertmanager that
`appliance up` starts: forged alerts through Alertmanager (refused: alerts confirm, never command), a SIGKILLed
engine whose port a squatter fills during its restart, a SIGSTOPped engine for longer than
maintenance.hung_after_seconds.

What must hold: only streams cut mid-way fail, each with an error event (no request is refused); routable
replicas never drop below min_ready_replicas (1) because of anything the appliance does; the squatter never
makes its replica ready and never gets a client request; every replica is back at the end; no zombie while it
runs and no engine process left after it stops. The counts are printed (pytest -s) for the record.

About 3-5 minutes on the 2-core CI machine (three engine starts); run under the heavy lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine.health import HEALTH_PROBE_TIMEOUT_SECONDS
from appliance.engine.replica import SupervisedReplica
from tests.integration.conftest import ADMIN_TOKEN, SHARED_ENV, monitoring_env
from tests.integration.harness import ApplianceProcess, serving
from tests.polling import eventually
from tests.processes import paused
from tests.tools import require_tool

pytestmark = pytest.mark.engine
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HUNG_AFTER = 4


# The supervisor marks a replica unhealthy after this long of failed probes (each a timeout, then the interval).
SETTLE_SECONDS = SupervisedReplica.HEALTH_FAILURES_UNHEALTHY * (SupervisedReplica.HEALTH_INTERVAL_SECONDS
                                                                + HEALTH_PROBE_TIMEOUT_SECONDS) + 2.0


def settled(check: Callable[[], bool], seconds: float) -> Callable[[], bool]:
    """A check that holds once ``check`` has been true on every look for ``seconds`` (a streak, reset by a miss)."""
    since: list[float] = []

    def holds() -> bool:
        if not check():
            since.clear()
            return False
        since[:] = since or [time.monotonic()]
        return time.monotonic() - since[0] >= seconds

    return holds


class Load:
    """Steady streamed completions from a few client threads; each request's fate is counted."""

    def __init__(self, gateway: str, clients: int = 2) -> None:
        self.gateway = gateway
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _client(self) -> None:
        body = {"model": "demo", "prompt": "The import system", "max_tokens": 24, "stream": True}
        while not self._stop.is_set():
            self.outcomes["sent"] += 1
            try:
                with httpx.stream("POST", f"{self.gateway}/v1/completions", json=body, timeout=600) as response:
                    if response.status_code != 200:
                        self._failed("refused", f"HTTP {response.status_code}: {response.read()[:200]!r}")
                        continue
                    events = [line for line in response.iter_lines() if line.startswith("data: ")]
            except httpx.HTTPError as exc:
                self._failed("transport", repr(exc))
                continue
            if events and events[-1] == "data: [DONE]":
                self.outcomes["ok"] += 1
            elif events and "error" in json.loads(events[-1][6:]):
                self._failed("cut_with_error_event", events[-1][:200])
            else:
                self._failed("cut_silently", (events or ["<no event>"])[-1][:200])

    def _failed(self, kind: str, detail: str) -> None:
        self.outcomes[kind] += 1
        self.failures.append(f"{kind}: {detail}")


class Watch:
    """Samples routable replicas (/admin/status) every 0.25 s and the appliance's zombie children."""

    def __init__(self, app: ApplianceProcess) -> None:
        self.app = app
        self.min_ready = 99
        self.samples = 0
        self.ready_while: dict[str, int] = Counter()  # replica -> samples it was ready while a squatter held it
        self.squatted: str | None = None
        self.zombie_seen: dict[int, float] = {}  # pid -> first seen as a zombie (monotonic)
        self.zombie_last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def lasting_zombies(self, seconds: float = 5.0) -> list[int]:
        """Zombies nobody reaped for ``seconds``: an exited process is a zombie until its parent waits for it,
        which the launcher and the supervisor do within a second; one that stays is a reaping bug."""
        return [pid for pid, first in self.zombie_seen.items() if self.zombie_last[pid] - first > seconds]

    def status(self) -> dict:
        return httpx.get(f"{self.app.url}/admin/status", headers=ADMIN, timeout=5).json()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                status = self.status()
                self.min_ready = min(self.min_ready, status["ready_replicas"])
                self.samples += 1
                for r in status["replicas"]:
                    if r["name"] == self.squatted and r["state"] == "ready":
                        self.ready_while[r["name"]] += 1
            with contextlib.suppress(psutil.Error):
                now = time.monotonic()
                for p in psutil.Process(self.app.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if p.status() == psutil.STATUS_ZOMBIE:
                            self.zombie_seen.setdefault(p.pid, now)
                            self.zombie_last[p.pid] = now
            time.sleep(0.25)


class Squatter:
    """Somebody else's HTTP server on an engine's port: 200 to everything; counts what it was sent."""

    def __init__(self, port: int, within: float = 60) -> None:
        outer = self
        self.requests: Counter[str] = Counter()

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.requests[self.path.split("?")[0]] += 1
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *_args) -> None:
                pass

        deadline = time.monotonic() + within
        while True:  # the killed engine's socket goes away with it; take the port before the restart binds it
            try:
                self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def forge_alerts(alertmanager: str, replicas: list[str]) -> None:
    """What anyone who reaches Alertmanager can do: post firing alerts, no credentials needed."""
    now = datetime.now(UTC).isoformat()
    alerts = [{"labels": {"alertname": "ApplianceReplicaHung", "replica": name, "severity": "warning",
                          "remediation": "auto"}, "startsAt": now} for name in replicas]
    assert httpx.post(f"{alertmanager}/api/v2/alerts", json=alerts, timeout=10).status_code == 200


def maintenance_results(app: ApplianceProcess) -> dict[str, float]:
    """appliance_maintenance_actions_total of alert-triggered actions, by result."""
    results: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{app.url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "appliance_maintenance_actions_total" and sample.labels.get("trigger") == "alert":
                results[sample.labels["result"]] = results.get(sample.labels["result"], 0) + sample.value
    return results


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def chaos_appliance(demo_model_int8, tmp_path_factory) -> Iterator[tuple[ApplianceProcess, str]]:
    require_tool("prometheus", "prometheus")
    require_tool("prometheus-alertmanager", "prometheus-alertmanager")
    env = {**SHARED_ENV, **monitoring_env(tmp_path_factory),
           "APPLIANCE_MAINTENANCE__MIN_READY_REPLICAS": "1",
           "APPLIANCE_MAINTENANCE__HUNG_AFTER_SECONDS": str(HUNG_AFTER),
           "APPLIANCE_MAINTENANCE__ALERT_ACTION_MIN_INTERVAL_SECONDS": "0",  # only the controller's guards hold
           "APPLIANCE_DRAIN_TIMEOUT_SECONDS": "10"}
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("chaos"), replicas=2, env=env,
                           command="up")
    with serving(app) as running:
        yield running, f"http://127.0.0.1:{env['APPLIANCE_MONITORING__ALERTMANAGER_PORT']}"


def test_chaos_under_streaming_load(chaos_appliance) -> None:
    app, alertmanager = chaos_appliance
    timeline: list[str] = []
    started = time.monotonic()

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - started:6.1f}s {what}")

    def both_ready() -> bool:
        return app.ready_replicas() == 2

    with Watch(app) as watch, Load(app.url) as load:
        eventually(lambda: load.outcomes["ok"] >= 4, 60, "load flowing")
        note("load flowing")

        # 1. Forged ApplianceReplicaHung for every replica, through the real Alertmanager. Alerts confirm, never
        #    command: both replicas make progress by the appliance's own view, so nothing is restarted.
        forge_alerts(alertmanager, ["replica-0", "replica-1"])
        eventually(lambda: maintenance_results(app).get("not_confirmed", 0) >= 2, 90,
                   "the webhook refused both forged alerts (not confirmed by its own view)")
        restarts = {r["name"]: r["restarts"] for r in watch.status()["replicas"]}
        note(f"forged alerts refused: {maintenance_results(app)}, restarts {restarts}")
        assert sorted(restarts.values()) == [0, 0], restarts

        # 2. SIGKILL one engine; a squatter takes its port while the supervisor restarts it.
        victim = 1
        name, port = f"replica-{victim}", app.engine_port(victim)
        os.kill(app.vllm_server_pid(victim), signal.SIGKILL)
        # During its restart: once the supervisor has seen the death and taken it out of routing. (Before that,
        # for the fraction of a second it takes to notice, the gateway may still send it a request.)
        eventually(lambda: next(r["state"] for r in watch.status()["replicas"] if r["name"] == name) != "ready", 30,
                   f"{name} out of routing after the SIGKILL")
        squatter = Squatter(port)
        watch.squatted = name
        note(f"SIGKILLed {name}; squatter on :{port}")
        eventually(lambda: squatter.requests["/health"] >= 3, 60, "the squatter answered health probes")
        time.sleep(10)
        watch.squatted = None
        squatter.close()
        note(f"squatter gone after {dict(squatter.requests)}")
        eventually(both_ready, 400, f"{name} back after the squatter left")
        note(f"{name} back")

        # 3. SIGSTOP the other engine for longer than hung_after_seconds, then let it go on.
        frozen_index = 1 - victim
        with paused(psutil.Process(app.vllm_server_pid(frozen_index))):
            note(f"SIGSTOPped replica-{frozen_index}")
            time.sleep(HUNG_AFTER + 8)
        note(f"SIGCONTed replica-{frozen_index}")
        # A probe that timed out while the engine was stopped can still be the third failure in a row just
        # after SIGCONT, and flip it unhealthy for one probe: "back" means ready on every look for longer
        # than the supervisor's failure window, not ready once.
        eventually(settled(both_ready, SETTLE_SECONDS), 400, "every replica ready (and staying so) at the end")
        done = load.outcomes["ok"]
        eventually(lambda: load.outcomes["ok"] >= done + 4, 120, "load flowing again")
        note("both ready; load flowing")
        final = watch.status()

    stats = dict(load.outcomes)
    print("\nchaos timeline:\n  " + "\n  ".join(timeline))
    print(f"chaos requests: {stats}; min routable replicas seen {watch.min_ready} over {watch.samples} samples; "
          f"zombies seen {len(watch.zombie_seen)} (each reaped within "
          f"{max((watch.zombie_last[p] - t for p, t in watch.zombie_seen.items()), default=0):.1f}s)")
    for failure in load.failures:
        print("  failed:", failure)
    assert stats.get("refused", 0) == 0 and stats.get("transport", 0) == 0 and stats.get("cut_silently", 0) == 0, \
        load.failures
    assert watch.min_ready >= 1
    assert watch.ready_while == {}, "a replica was ready while a squatter held its port"
    assert set(squatter.requests) <= {"/health", "/metrics"}, squatter.requests  # no client request reached it
    assert [r["state"] for r in final["replicas"]] == ["ready", "ready"]
    assert watch.lasting_zombies() == []
    app.stop(signal.SIGTERM)
    eventually(lambda: not app.leftover_engine_processes(), 60, "no engine process left after the stop")
