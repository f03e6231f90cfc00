"""``appliance quantize`` through the appliance's command line: --scheme, the JSON summary, one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.cli.model import SCHEME_NAMES as CLI_SCHEMES
from appliance.model.precision import SCHEME_NAMES


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)


def test_scheme_names_agree() -> None:
    assert CLI_SCHEMES == SCHEME_NAMES


def test_quantize_fp8_prints_the_summary(demo_model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["quantize", str(demo_model_dir), str(tmp_path / "fp8"), "--scheme", "fp8", "--no-eval"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"] == "fp8" and summary["bytes_after"] < summary["bytes_before"]
    assert (tmp_path / "fp8" / "config.json").is_file()


def test_bad_input_is_one_line(demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["quantize", str(demo_model_dir), str(tmp_path / "x"), "--scheme", "int4"]) == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert run_cli(["quantize", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance quantize: ") and "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
