"""Engine output: a rotating file in the state folder, and optionally the appliance's own stdout.

Why: in a container the state folder is a volume nobody reads until something went wrong, and a file that only
grows fills it; the container's stdout is what ``docker compose logs`` and every log shipper read. So each line an
engine writes goes to ``logs/engine-N.log`` (rotated by size, a bounded number kept) and, when asked, to stdout
with the replica's name in front, so that interleaved lines of several replicas stay attributable.

The engine must never wait for its log: a pipe nobody empties stalls vLLM at its next print (64 KiB on Linux), with
the requests in flight. So one thread only reads the pipe, until EOF (the process and every child holding the pipe
exited), and hands lines over through bounded queues; other threads write them. A burst waits for room (the pipe
buffers the engine meanwhile); a writer stuck for ``STALL_SECONDS`` (a hung disk, a log driver that pushes back on
stdout) costs lines, counted and noted in that destination, never more of the engine's progress. Each destination
has its own queue and writer, so a blocked stdout does not cost the file its lines. A destination that fails is
dropped (logged once) and the others go on; if every one failed, the reader still empties the pipe. A line longer
than ``MAX_LINE_BYTES`` is cut into pieces rather than buffered without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import IO, TextIO

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 1024
QUEUE_LINES = 2048  # lines waiting for one destination's writer; beyond, dropped (bounded: 2048 x MAX_LINE_BYTES)
STALL_SECONDS = 1.0  # the longest the reader waits for one destination before it drops that one's lines
_POLL_SECONDS = 0.2


class _Strict:
    """A logging handler that raises instead of printing "--- Logging error ---" for every line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        raise  # called from emit's except block: re-raises what emit caught


class _FileHandler(_Strict, RotatingFileHandler):
    pass


class _StreamHandler(_Strict, logging.StreamHandler[TextIO]):
    pass


class _Sink:
    """One destination with its own queue and writer thread: a slow one (stdout pushed back by a log driver)
    loses its own lines, not the file's."""

    def __init__(self, pump: str, handler: logging.Handler) -> None:
        self.pump = pump
        self.handler = handler
        self.lines: queue.Queue[str] = queue.Queue(maxsize=QUEUE_LINES)
        self.dropped = 0  # lines this destination could not keep up with
        self.alive = True
        self.behind = False  # stalled past STALL_SECONDS: lines are dropped, not waited for, until it catches up
        self.thread: threading.Thread | None = None

    def offer(self, line: str) -> None:
        """Queue a line: wait up to STALL_SECONDS for room (bursts are normal; the pipe buffers the engine
        meanwhile), then give up on this destination's lines until its writer has caught up."""
        if not self.alive:
            return
        try:
            if self.behind:
                self.lines.put_nowait(line)
            else:
                self.lines.put(line, timeout=STALL_SECONDS)
        except queue.Full:
            self.dropped += 1
            self.behind = True

    def start(self, eof: threading.Event) -> None:
        self.thread = threading.Thread(target=self._run, args=(eof,), daemon=True,
                                       name=f"{self.pump}-log-{self.describe()}")
        self.thread.start()

    def _run(self, eof: threading.Event) -> None:
        noted = 0
        try:
            while self.alive:
                try:
                    line = self.lines.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    if eof.is_set():
                        return
                    continue
                if self.dropped != noted:
                    self.emit(f"=== appliance: {self.dropped - noted} engine output lines dropped here "
                              "(this log could not keep up)")
                    noted = self.dropped
                self.emit(line)
                if self.behind and self.lines.empty():
                    self.behind = False
        except BaseException:  # noqa: BLE001 - the reader goes on emptying the pipe
            log.exception("%s: engine log writer for %s failed", self.pump, self.describe())
            self.alive = False

    def emit(self, line: str) -> None:
        if not self.alive:
            return
        record = logging.LogRecord(f"engine.{self.pump}", logging.INFO, __file__, 0, line, None, None)
        try:
            self.handler.handle(record)
        except Exception as exc:  # noqa: BLE001 - one broken destination must not silence the others
            log.error("%s: engine output no longer goes to %s: %s: %s", self.pump, self.describe(),
                      type(exc).__name__, exc)
            self.alive = False

    def describe(self) -> str:
        return self.handler.baseFilename if isinstance(self.handler, RotatingFileHandler) else "stdout"


class EngineLogPump:
    """Tee one engine process' output to a rotating file and, optionally, to a stream with a prefix."""

    def __init__(self, name: str, path: Path, *, max_bytes: int, backups: int,
                 stdout: TextIO | None = None) -> None:
        self.name = name
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _FileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(message)s"))
        self._sinks = [_Sink(name, file_handler)]
        if stdout is not None:
            stream_handler = _StreamHandler(stdout)
            stream_handler.setFormatter(logging.Formatter(f"[{name}] %(message)s"))
            self._sinks.append(_Sink(name, stream_handler))
        self._eof = threading.Event()
        self._reader: threading.Thread | None = None
        self.lines_read = 0  # lines the engine wrote (not the appliance's own): none yet is a start that hangs

    @property
    def dropped(self) -> int:
        """Lines lost by the destination that lost most (a blocked stdout: its own)."""
        return max(sink.dropped for sink in self._sinks)

    def write(self, line: str) -> None:
        """One line from the appliance itself (e.g. the start header), before ``start``."""
        for sink in self._sinks:
            sink.emit(line.rstrip("\n"))

    def start(self, pipe: IO[bytes]) -> None:
        """Read ``pipe`` (the engine's stdout, stderr merged into it) in the background until EOF."""
        for sink in self._sinks:
            sink.start(self._eof)
        self._reader = threading.Thread(target=self._read, args=(pipe,), daemon=True, name=f"{self.name}-log-reader")
        self._reader.start()

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the pump to drain after the process exited, then close the file. Blocking: call it
        from a thread when on an event loop."""
        deadline = time.monotonic() + timeout
        for thread in [self._reader, *(sink.thread for sink in self._sinks)]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        for sink in self._sinks:
            # A reader still held open by an escaped child goes on emptying the pipe, into nothing.
            sink.alive = False
            sink.handler.close()

    def _read(self, pipe: IO[bytes]) -> None:
        """The only thing that waits here is the pipe: a full destination drops lines instead."""
        try:
            with pipe:
                for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                    self.lines_read += 1
                    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                    for sink in self._sinks:
                        sink.offer(line)
        except Exception:  # noqa: BLE001 - whatever happened, the pipe must not fill up behind the engine
            log.exception("%s: engine log reader failed; discarding the rest of its output", self.name)
            try:
                while pipe.read(MAX_LINE_BYTES):
                    pass
            except (OSError, ValueError):
                pass
        finally:
            self._eof.set()
