"""Engine output: every line in the rotating file and, when asked, on the appliance's stdout with its replica."""

from __future__ import annotations

import io
import subprocess
import sys
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
