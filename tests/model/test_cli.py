"""``appliance quantize`` through argparse: --scheme, the JSON summary, one-line refusals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from appliance.model.cli import SCHEMES, register
from appliance.model.precision import SCHEME_NAMES


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="appliance")
    register(parser.add_subparsers(title="commands"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return int(args.handler(args))


def test_scheme_names_agree() -> None:
    assert SCHEMES == SCHEME_NAMES


def test_quantize_fp8_prints_the_summary(demo_model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["quantize", str(demo_model_dir), str(tmp_path / "fp8"), "--scheme", "fp8", "--no-eval"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"] == "fp8" and summary["bytes_after"] < summary["bytes_before"]
    assert (tmp_path / "fp8" / "config.json").is_file()


def test_bad_input_is_one_line(demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["quantize", str(demo_model_dir), str(tmp_path / "x"), "--scheme", "int4"]) == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert run_cli(["quantize", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("appliance quantize: ") and "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
