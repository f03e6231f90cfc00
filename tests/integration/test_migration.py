"""Streams that survive an engine's death, on 2 real vLLM replicas.

12 greedy completion streams and 12 greedy chat streams of 800 tokens each run at once; mid-way, one replica is
struck while streams run on it: its vLLM server SIGKILLed (on the shared appliance), or a maintenance restart (the
per-replica step of a rolling restart) whose drain timeout (0.5 s, an appliance of its own) is far shorter than the
streams. What must hold: every stream ends
whole (one finish_reason, "length"; usage says exactly 800 completion tokens; [DONE]; no error event), and the
streams that were running on the struck replica were continued by the other one (the gateway's migration
counter, by reason). The texts are compared with an undisturbed greedy run of the same requests; the count of
identical ones, where the others part, and the longest pause each moved stream saw are printed (pytest -s).

Texts: vLLM's CPU kernels compute a continuation's prefill (the sent tokens re-read as prompt) and the original
decode steps with different reductions, so a greedy argmax that is a near tie can flip a few tokens after the
break; the demo model is tiny and has many near ties. The test requires every stream whole, most moved streams
identical to the undisturbed run in full (a continuation from wrong tokens would change all of them at their
break), and prints how many are identical and where the others part from the undisturbed text.

The SIGKILL test: about a minute of streaming plus one engine restart (25-100 s), back before it ends. The restart
test: one appliance start plus a minute of streaming; the appliance stops while the replica restarts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine.load import parse_engine_load
from tests.integration.conftest import ADMIN_TOKEN, SHARED_ENV
from tests.integration.harness import ApplianceProcess, serving
from tests.polling import eventually
from tests.processes import paused

pytestmark = pytest.mark.engine
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

TOKENS = 800
PROMPTS = ["The import system", "Functions are", "A module is", "Exceptions can be", "The class statement",
           "Assignment statements", "The for statement", "Identifiers and keywords", "Comparisons", "Generators",
           "The with statement", "Numeric types"]


@dataclass
class Stream:
    route: str
    prompt: str
    replica: str = ""
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False
    errors: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic, per event
    texts_at: list[int] = field(default_factory=list)  # len(text) after each event

    def body(self) -> dict:
        base = {"prompt": self.prompt} if self.route == "completions" else {
            "messages": [{"role": "user", "content": self.prompt}]}
        return {**base, "model": "demo", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    def run(self, url: str) -> None:
        path = "/v1/completions" if self.route == "completions" else "/v1/chat/completions"
        try:
            with httpx.stream("POST", url + path, json=self.body(), timeout=300) as response:
                self.replica = response.headers.get("x-appliance-replica", "")
                if response.status_code != 200:
                    self.errors.append(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.arrivals.append(time.monotonic())
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    self._event(json.loads(line[6:]))
                    self.texts_at.append(len(self.text))
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))

    def _event(self, obj: dict) -> None:
        if "error" in obj:
            self.errors.append(obj["error"]["message"])
            return
        for choice in obj.get("choices") or []:
            self.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                self.finishes.append(choice["finish_reason"])
        if obj.get("usage"):
            self.usage = obj["usage"]

    def whole(self) -> bool:
        return (self.done and not self.errors and self.finishes == ["length"]
                and (self.usage or {}).get("completion_tokens") == TOKENS)

    def text_before(self, moment: float) -> str:
        """What the client had been sent by ``moment``."""
        sent = [at for at, arrived in zip(self.texts_at, self.arrivals, strict=False) if arrived <= moment]
        return self.text[:sent[-1]] if sent else ""


def run_all(url: str, streams: list[Stream]) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.run, args=(url,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return threads


def streams() -> list[Stream]:
    return [Stream(route, prompt) for route in ("completions", "chat") for prompt in PROMPTS]


def migrations(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "appliance_stream_migrations_total":
                out[(sample.labels["reason"], sample.labels["outcome"])] = sample.value
    return out


def added_seconds(url: str) -> str:
    """appliance_stream_migration_added_seconds (break to the continuation's first relayed event): count, mean."""
    count = total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "appliance_stream_migration_added_seconds_count":
                count += sample.value
            elif sample.name == "appliance_stream_migration_added_seconds_sum":
                total += sample.value
    return f"{count:.0f} observed, mean {total / count:.3f}s" if count else "none observed"


def engine_running(url: str) -> int:
    """vllm:num_requests_running read from the engine itself, now (the gateway's load poll is up to a poll old),
    with the gateway's own parser of an engine's page."""
    load = parse_engine_load(httpx.get(f"{url}/metrics", timeout=30).content, time.monotonic())
    return int(load.running or 0)


def run_scenario(url: str, disturb: Callable[[str], None], what: str, *, replica: str | None = None,
                 reason: str | None = None, after_events: int = TOKENS // 8,
                 running_now: Callable[[str], int] | None = None) -> None:
    """An undisturbed run of the streams, then the same streams with ``disturb(replica)`` applied mid-way to a
    replica with streams in flight (``replica`` if given); the checks and the report. ``running_now(replica)``, when
    given, is the engine's own count of running requests read at the moment of the strike."""
    baseline = streams()
    started = time.monotonic()
    for thread in run_all(url, baseline):
        thread.join(timeout=300)
    print(f"\nundisturbed: {len(baseline)} streams of {TOKENS} tokens in {time.monotonic() - started:.1f}s")
    assert all(s.whole() for s in baseline), [(s.route, s.prompt, s.errors, s.finishes, s.usage) for s in baseline
                                              if not s.whole()]

    # Both replicas in rotation first: a replica's first answers after its start can be TTFT outliers and get it
    # ejected for seconds, which would leave one replica with nowhere to move streams (and maintenance refuses to
    # restart the other one then).
    eventually(lambda: (h := httpx.get(f"{url}/health/ready", timeout=10).json())["routable_replicas"] == 2
               and h["ejected_replicas"] == 0, 120, "both replicas routable and none ejected")
    disturbed: list[Stream] = []

    # Struck mid-way: on a replica where the gateway has streams in flight (its own count) and the client is
    # receiving streams that have a good part of their answer and are not done. Both views are needed: the
    # client's lags the gateway's on a loaded host (a stream done there may still be arriving here), and the
    # gateway's counts requests still waiting for their first token too; the demo model streams 800 tokens in
    # seconds. Which streams the gateway moved is its own count (the migration counter).
    # The engine's own running count too (its last load poll): a CI run struck a replica whose streams the
    # engine had all finished while the gateway still relayed them to slow clients, and nothing was left to move.
    # A status read slower than its timeout under load is "not yet", not a failure (another CI run). That engine
    # count is the gateway's last poll (up to a second old, more under load): a third CI run struck a replica whose
    # engine had finished its 5 streams since, so the strike reads the engine itself when it can (running_now).
    # At most 4 such reads a second: vLLM renders /metrics on its API server's event loop, and reading it at this
    # loop's 50 Hz starved the engines' answers to the gateway (a CI run: 502s before the first byte).
    last_read = 0.0

    def fresh_running(name: str) -> bool:
        nonlocal last_read
        if running_now is None:
            return True
        if time.monotonic() - last_read < 0.25:
            return False
        last_read = time.monotonic()
        return running_now(name) >= 1

    def ready() -> str | None:
        try:
            status = httpx.get(f"{url}/admin/status", headers=ADMIN, timeout=30).json()
        except httpx.TimeoutException:
            return None
        for r in sorted(status["replicas"], key=lambda r: -r["outstanding"]):
            running = [s for s in disturbed if s.replica == r["name"] and not s.done
                       and after_events <= len(s.arrivals) <= TOKENS // 2]
            if replica in (None, r["name"]) and r["outstanding"] >= (1 if after_events else 3) \
                    and (running or not after_events) and (r.get("engine_running") or 0) >= 1 \
                    and fresh_running(r["name"]):
                return r["name"]
        return None

    # A batch can end before every condition holds at one look (a CI run: 24 streams done in about 12 s and no
    # strike within 120 s): then it is checked whole like the undisturbed run, and another batch is sent.
    victim = None
    for batch in range(1, 4):
        before = migrations(url)
        disturbed = streams()
        threads = run_all(url, disturbed)
        deadline = time.monotonic() + 120
        while victim is None and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            victim = ready()
            time.sleep(0 if victim else 0.02)
        if victim is not None:
            break
        for thread in threads:
            thread.join(timeout=300)
        assert all(s.whole() for s in disturbed), [(s.route, s.prompt, s.errors) for s in disturbed if not s.whole()]
        print(f"batch {batch}: no moment with every strike condition; sending another batch")
    if victim is None:
        pytest.fail("no replica with streams in flight in 3 batches")
    struck_at = time.monotonic()
    disturb(victim)
    for thread in threads:
        thread.join(timeout=300)
    after = migrations(url)

    on_victim = [s for s in disturbed if s.replica == victim]
    broken = [(s.route, s.prompt, s.errors, s.finishes, s.usage, s.done) for s in disturbed if not s.whole()]
    identical = [s for s, b in zip(disturbed, baseline, strict=True) if s.text == b.text]
    victim_identical = [s for s in identical if s in on_victim]
    gaps = sorted(max(b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)) for s in on_victim)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    continued = sum(v for k, v in delta.items() if k[1] == "continued")
    print(f"{what}: {len(on_victim)} of {len(disturbed)} streams on {victim}; migrations {delta}; gateway's "
          f"added latency: {added_seconds(url)}; {len(disturbed) - len(broken)} whole; identical to the "
          f"undisturbed run: {len(identical)}/{len(disturbed)} ({len(victim_identical)}/{len(on_victim)} of those "
          f"on {victim}); longest pause between two events of each stream on {victim}, client side (s): "
          f"{[round(g, 2) for g in gaps]}")
    for s, b in zip(disturbed, baseline, strict=True):
        if s.text != b.text:
            where = next((i for i, (x, y) in enumerate(zip(s.text, b.text, strict=False)) if x != y),
                         min(len(s.text), len(b.text)))
            print(f"  differs: {s.route} {s.prompt!r} (on {s.replica}) at char {where} of {len(b.text)}; received "
                  f"before the {what}: {len(s.text_before(struck_at))} chars")

    assert broken == [], broken
    assert continued >= 1, delta
    assert not [k for k in delta if k[1] != "continued"], delta  # none failed, ineligible or exhausted
    if reason is not None:
        assert delta.get((reason, "continued"), 0) == continued, delta
    # A continuation built from the wrong tokens (one dropped or repeated at the break) would change every moved
    # stream right at its break; a greedy near tie flipped by the continuation's prefill numerics changes a few.
    assert len(victim_identical) * 2 >= len(on_victim), f"most streams on {victim} differ from the undisturbed run"
    assert_records_show_the_moves(url, victim, continued, reason)


def assert_records_show_the_moves(url: str, victim: str, continued: int, reason: str | None) -> None:
    """The request records (GET /admin/requests) tell each moved stream's story: the attempt on the struck replica
    ended as migrated, and the migration names where it went and why."""
    held = httpx.get(f"{url}/admin/requests", params={"limit": 1000, "replica": victim}, headers=ADMIN,
                     timeout=30).json()["requests"]
    moves = [m for r in held for m in r["migrations"] if m["from_replica"] == victim]
    assert len(moves) >= continued, (continued, moves)
    for move in moves:
        assert move["to_replica"] not in (None, victim) and move["outcome"] == "continued", move
        assert reason is None or move["reason"] == reason, move


def test_streams_survive_a_sigkilled_engine_token_exact(appliance):
    appliance.wait_ready(timeout=300)

    def kill(name: str) -> None:
        os.kill(appliance.vllm_server_pid(int(name.rsplit("-", 1)[1])), signal.SIGKILL)

    def running_now(name: str) -> int:
        return engine_running(f"http://127.0.0.1:{appliance.engine_port(int(name.rsplit('-', 1)[1]))}")

    run_scenario(appliance.url, kill, "SIGKILL", reason="connection", running_now=running_now)
    appliance.wait_ready(timeout=400)  # the supervisor restarted the killed engine; later tests need both


@pytest.fixture(scope="module")
def short_drain(demo_model_int8, tmp_path_factory):
    """An appliance of its own whose drain timeout (0.5 s) is far shorter than the streams (the shared one: 60 s).
    vLLM's own --shutdown-timeout is a second drain inside the engine (it finishes in-flight requests for that
    long on SIGTERM): 0 here, so vLLM aborts them at once, as it does when that timeout is shorter than they are."""
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("short-drain"), replicas=2,
                           env={**SHARED_ENV, "APPLIANCE_DRAIN_TIMEOUT_SECONDS": "0.5",
                                "APPLIANCE_ENGINE__SHUTDOWN_TIMEOUT_SECONDS": "0",
                                # 4 sequences at a time per engine (the gateway queues the rest): the struck
                                # engine is mid-way through a batch when its drain times out. With 32, a CI run
                                # on a loaded host saw every stream finish at the engine before the restart's
                                # drain ended (the gateway still relaying them to slow clients): nothing to move.
                                "APPLIANCE_ENGINE__MAX_NUM_SEQS": "4",
                                # a replica's slow first answers on this host must not eject the other one
                                # while this one restarts: maintenance would refuse the restart (409)
                                "APPLIANCE_ROUTING__LATENCY_OUTLIER_FACTOR": "1000",
                                # nor may the other one be taken out of routing because its API server, on a
                                # CPU shared with 24 streams and the compose build, answered /health in over 2 s
                                # three times in a row: a CI run saw both replicas marked unhealthy that way
                                "APPLIANCE_ENGINE__HEALTH_TIMEOUT_SECONDS": "10"})
    with serving(app) as running:
        yield running


def test_a_restart_whose_drain_times_out_moves_the_streams_instead_of_cutting_them(short_drain):
    """The step a rolling restart takes for each replica in turn (RestartProcedure: drain, wait up to
    drain_timeout_seconds, restart, warm, undrain), asked for through the admin API on the replica the gateway
    sent streams to (a rolling restart always starts with replica-0, which prefix affinity or a TTFT-outlier
    ejection after its start may have left without streams)."""
    log = short_drain.state_dir / "appliance.log"

    def drain_timeouts(name: str) -> int:
        """How often the appliance has logged that ``name``'s drain timed out (RestartProcedure)."""
        return sum(1 for line in log.read_text(errors="replace").splitlines()
                   if f"{name}: " in line and "still in flight after the drain timeout" in line)

    def restart(name: str) -> None:
        # The struck engine's model work is paused from the restart until its drain has timed out: on an idle
        # host the engine finished its 4 running streams within the half-second drain (a run of this test alone
        # saw no migration at all), and the drain must time out with streams mid-way for this test to mean
        # anything. Its API server still answers; the appliance stops it after the timeout.
        timeouts = drain_timeouts(name)
        with paused(*short_drain.engine_core_processes(int(name.rsplit("-", 1)[1]))):
            response = httpx.post(f"{short_drain.url}/admin/replicas/{name}/restart", headers=ADMIN, timeout=30)
            assert response.status_code == 202, response.text
            eventually(lambda: drain_timeouts(name) > timeouts, 60, f"{name}'s drain timed out", interval=0.05)

    # Struck as soon as the gateway has streams in flight there (no client-side condition: the engine finishes
    # 800 tokens long before a client on this host has read them).
    run_scenario(short_drain.url, restart, "restart", reason="drain", after_events=0)
