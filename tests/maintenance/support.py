"""Restartable replica doubles (from tests.doubles), controllable clocks, and a hung replica as the app's own
progress monitor sees one."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from appliance.context import context_of
from tests.doubles import restartable_fleet

fleet = restartable_fleet


class Clock:
    """Wall time (aware datetime) and a monotonic reading that move together, by hand."""

    def __init__(self, start: datetime) -> None:
        self.wall = start
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds

    def set(self, moment: datetime) -> None:
        self.mono += (moment - self.wall).total_seconds()
        self.wall = moment


def judge_hung(client, *names: str) -> None:
    """Make the app's own progress monitor find ``names`` hung the way it does in production: engine readings
    (recorded through the router, as its load poller does) with requests running and a generation counter that
    stands still for the whole hung period."""
    from appliance.engine.load import EngineLoad

    router = context_of(client.app).gateway.router
    progress = context_of(client.app).maintenance.progress
    now = time.monotonic()
    for at in (now - progress.hung_after_seconds, now):
        for name in names:
            router.update_load(name, EngineLoad(running=1, generation_tokens_total=7, read_at=at))
        progress.check(at)
    assert set(names) <= set(progress.hung())


class EngineMetricsStub:
    """An engine's /metrics page (vLLM's names) whose request counters the test sets, and /health; a real HTTP
    server in a thread, for unit tests of what maintenance reads from engines (never a claim about vLLM)."""

    def __init__(self) -> None:
        import http.server
        import threading

        stub = self
        self.finished = 0.0
        self.running = 0.0
        self.waiting = 0.0
        self.reads = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path == "/metrics":
                    stub.reads += 1
                    body = (
                        "# TYPE vllm:request_success_total counter\n"
                        f'vllm:request_success_total{{finished_reason="stop",model_name="demo"}} {stub.finished}\n'
                        'vllm:request_success_total{finished_reason="length",model_name="demo"} 0.0\n'
                        f'vllm:num_requests_running{{model_name="demo"}} {stub.running}\n'
                        f'vllm:num_requests_waiting{{model_name="demo"}} {stub.waiting}\n'
                        'vllm:generation_tokens_total{model_name="demo"} 10.0\n'
                    ).encode()
                else:
                    body = b"ok"
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                return None

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
