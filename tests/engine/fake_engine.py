"""A stand-in engine process for the supervisor's life-cycle tests: answers 200 on /health at 127.0.0.1:PORT.

Run as ``python fake_engine.py PORT`` (listens), or ``python fake_engine.py PORT --no-listen`` (alive, never
binds: a process that is not serving), ``--ignore-term`` (ignores SIGTERM), ``--exit-after SECONDS CODE``
(serves, then exits with CODE: a crash), ``--chatter LINES`` (prints LINES numbered lines, every tenth to
stderr, before it listens: an engine's start-up output)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *_args) -> None:
        pass


def main(argv: list[str]) -> None:
    port = int(argv[0])
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--chatter" in argv:
        for i in range(int(argv[argv.index("--chatter") + 1])):
            print(f"fake engine line {i:06d} " + "x" * 60, file=sys.stderr if i % 10 == 0 else sys.stdout)
        sys.stdout.flush()
    if "--no-listen" in argv:
        while True:
            time.sleep(1)
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    if "--exit-after" in argv:
        at = argv.index("--exit-after")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(float(argv[at + 1]))
        sys.exit(int(argv[at + 2]))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
