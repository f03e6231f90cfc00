"""A stand-in engine process for the supervisor's own unit tests: answers GET /health on the port it is given,
and exits with a code after a while when asked to. It is never what a serving test verifies.

    python fake_engine.py PORT [EXIT_AFTER_SECONDS EXIT_CODE]
"""

import http.server
import sys
import threading
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if len(sys.argv) > 3:
        time.sleep(float(sys.argv[2]))
        sys.exit(int(sys.argv[3]))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
