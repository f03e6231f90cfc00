"""Engine output: every line in the rotating file and, when asked, on the appliance's stdout with its replica."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
from pathlib import Path

from appliance.engine.logs import MAX_LINE_BYTES, EngineLogPump


def _run_through_pump(pump: EngineLogPump, code: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    pump.start(proc.stdout)
    status = proc.wait(timeout=30)
    pump.close()
    return status


def test_a_process_output_reaches_the_file_and_the_prefixed_stream(tmp_path: Path) -> None:
    out = io.StringIO()
    pump = EngineLogPump("replica-1", tmp_path / "logs" / "replica-1.log", max_bytes=1_000_000, backups=2,
                         stdout=out)
    pump.write("=== appliance: starting replica-1\n")
    code = "import sys; print('from stdout'); print('from stderr', file=sys.stderr, flush=True); print('last')"
    assert _run_through_pump(pump, code) == 0
    lines = (tmp_path / "logs" / "replica-1.log").read_text().splitlines()
    assert lines[0] == "=== appliance: starting replica-1"
    assert {"from stdout", "from stderr", "last"} <= set(lines[1:])
    assert out.getvalue().splitlines() == [f"[replica-1] {line}" for line in lines]


def test_without_a_stream_only_the_file_gets_the_lines(tmp_path: Path, capsys) -> None:
    pump = EngineLogPump("replica-0", tmp_path / "replica-0.log", max_bytes=1_000_000, backups=1)
    assert _run_through_pump(pump, "print('quiet')") == 0
    assert (tmp_path / "replica-0.log").read_text() == "quiet\n"
    assert capsys.readouterr().out == ""


def test_the_file_rotates_by_size_and_keeps_a_bounded_number(tmp_path: Path) -> None:
    path = tmp_path / "replica-0.log"
    pump = EngineLogPump("replica-0", path, max_bytes=2_000, backups=2)
    assert _run_through_pump(pump, "for i in range(1000): print(f'line {i:04d} ' + 'x' * 40)") == 0
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["replica-0.log", "replica-0.log.1", "replica-0.log.2"]
    assert all(f.stat().st_size <= 2_000 for f in files)
    assert path.read_text().splitlines()[-1].startswith("line 0999 ")  # the newest lines are in the live file


def test_an_endless_line_is_cut_not_buffered_and_bad_bytes_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "replica-0.log"
    pump = EngineLogPump("replica-0", path, max_bytes=10_000_000, backups=1)
    code = (f"import sys; sys.stdout.buffer.write(b'y' * {MAX_LINE_BYTES * 2 + 10}); "
            "sys.stdout.buffer.write(b'\\nbad \\xff byte\\n')")
    assert _run_through_pump(pump, code) == 0
    lines = path.read_text().splitlines()
    assert [len(line) for line in lines[:3]] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 10]
    assert lines[3] == "bad \ufffd byte"


class BlockedStream(io.StringIO):
    """A stdout that a log driver pushes back on: every write waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def write(self, text: str) -> int:
        self.released.wait()
        return super().write(text)


class BrokenStream(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


CHATTY = "import sys\nfor i in range(10000): print(f'line {i:05d} ' + 'z' * 60)\nsys.stdout.flush()"


def test_a_blocked_stdout_costs_its_own_lines_never_the_process_progress_nor_the_file(tmp_path: Path) -> None:
    stream = BlockedStream()
    path = tmp_path / "replica-0.log"
    pump = EngineLogPump("replica-0", path, max_bytes=100_000_000, backups=1, stdout=stream)
    proc = subprocess.Popen([sys.executable, "-c", CHATTY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    pump.start(proc.stdout)
    try:
        assert proc.wait(timeout=60) == 0  # 700 kB through a 64 KiB pipe: only possible if nobody waits on stdout
    finally:
        stream.released.set()
    pump.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 10000 and lines[-1].startswith("line 09999 ")  # the file lost nothing
    assert pump.dropped > 0
    assert "engine output lines dropped here" in stream.getvalue()


def test_a_broken_stdout_is_dropped_once_and_the_file_goes_on(tmp_path: Path, caplog, capsys) -> None:
    path = tmp_path / "replica-0.log"
    pump = EngineLogPump("replica-0", path, max_bytes=100_000_000, backups=1, stdout=BrokenStream())
    assert _run_through_pump(pump, CHATTY) == 0
    assert len(path.read_text().splitlines()) == 10000
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no longer goes to stdout" in errors[0].getMessage()
    assert "Logging error" not in capsys.readouterr().err  # not one traceback per line


def test_a_dead_writer_does_not_stop_the_pipe_from_being_emptied(tmp_path: Path, monkeypatch) -> None:
    def explode(self, line: str) -> None:
        raise SystemExit("writer died")

    pump = EngineLogPump("replica-0", tmp_path / "replica-0.log", max_bytes=100_000_000, backups=1)
    monkeypatch.setattr("appliance.engine.logs._Sink.emit", explode)
    assert _run_through_pump(pump, CHATTY) == 0  # would hang in proc.wait (TimeoutExpired) if the pipe filled
