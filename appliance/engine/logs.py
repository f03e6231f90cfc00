"""Engine output: a rotating file in the state folder, and optionally the appliance's own stdout.

Why: in a container the state folder is a volume nobody reads until something went wrong, and a file that only
grows fills it; the container's stdout is what ``docker compose logs`` and every log shipper read. So each line an
engine writes goes to ``logs/replica-N.log`` (rotated by size, a bounded number kept) and, when asked, to stdout
with the replica's name in front, so that interleaved lines of several replicas stay attributable.

One pump per engine process: a daemon thread that reads the process' stdout pipe line by line until EOF (the
process and every child holding the pipe exited). A line longer than ``MAX_LINE_BYTES`` is cut into pieces rather
than buffered without bound.
"""

from __future__ import annotations

import logging
import threading
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import IO, TextIO

MAX_LINE_BYTES = 64 * 1024


class EngineLogPump:
    """Tee one engine process' output to a rotating file and, optionally, to a stream with a prefix."""

    def __init__(self, name: str, path: Path, *, max_bytes: int, backups: int,
                 stdout: TextIO | None = None) -> None:
        self.name = name
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # An unregistered logger: engine lines never reach the appliance's own logging configuration.
        self._logger = logging.Logger(f"engine.{name}", logging.INFO)
        self._logger.propagate = False
        file_handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(file_handler)
        if stdout is not None:
            stream_handler = logging.StreamHandler(stdout)
            stream_handler.setFormatter(logging.Formatter(f"[{name}] %(message)s"))
            self._logger.addHandler(stream_handler)
        self._thread: threading.Thread | None = None

    def write(self, line: str) -> None:
        """One line from the appliance itself (e.g. the start header), through the same rotation."""
        self._logger.info(line.rstrip("\n"))

    def start(self, pipe: IO[bytes]) -> None:
        """Read ``pipe`` (the engine's stdout, stderr merged into it) in the background until EOF."""
        self._thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True, name=f"{self.name}-logs")
        self._thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                self._logger.info(raw.decode("utf-8", errors="replace").rstrip("\r\n"))

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the pump to drain after the process exited, then close the file."""
        if self._thread is not None:
            self._thread.join(timeout)
        for handler in list(self._logger.handlers):
            self._logger.removeHandler(handler)
            handler.close()
