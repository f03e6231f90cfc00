"""The three commands through argparse: bad input exits 2 with a message and writes nothing; good runs exit 0
and write their reports; a plan that cannot fit exits 1."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fake_engine import FakeEngine
from tests.loadtest.support import run_cli
from tests.loadtest.timing import retry_if_starved

Start = Callable[..., FakeEngine]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--model", "m", "--concurrency", "1", "--requests", "1", "--out", "X"], "--url"),
        (["bench", "--url", "http://h", "--model", "m", "--concurrency", "1", "--rate", "2", "--requests", "1",
          "--out", "X"], "not allowed with argument"),
        (["bench", "--url", "http://h", "--model", "m", "--requests", "1", "--out", "X"], "--concurrency --rate"),
        (["bench", "--url", "http://h", "--model", "m", "--concurrency", "0", "--requests", "1", "--out", "X"],
         "must be at least 1"),
        (["bench", "--url", "http://h", "--model", "m", "--rate", "-2", "--requests", "1", "--out", "X"],
         "must be a positive number"),
        (["bench", "--url", "http://h", "--model", "m", "--rate", "nan", "--requests", "1", "--out", "X"],
         "must be a positive number"),
        (["bench", "--url", "http://h", "--model", "m", "--concurrency", "1", "--requests", "1", "--out", "X",
          "--endpoint", "embeddings"], "invalid choice"),
        (["capacity", "--url", "http://h", "--model", "m", "--out", "X"], "--slo-ttft-p95-ms"),
        (["capacity", "--url", "http://h", "--model", "m", "--out", "X", "--slo-ttft-p95-ms", "100",
          "--confidence", "1"], "must be below 1"),
        (["plan", "--model-size", "llama-3-8b", "--max-len", "8192"], "--memory-gib"),
        (["plan", "--model-size", "llama-3-8b", "--memory-gib", "80", "--max-len", "8192", "--model-config", "c"],
         "not allowed with argument"),
        (["plan", "--model-size", "llama-3-8b", "--memory-gib", "80", "--max-len", "8k"], "not an integer"),
    ],
)
def test_bad_flags_exit_2_with_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_values_exit_2_and_write_nothing(tmp_path: Path, stub_server: Start,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stub = stub_server()
    out = tmp_path / "out"
    common = ["--model", "stub", "--concurrency", "1", "--requests", "2", "--out", str(out), "--no-progress"]
    chat_only = tmp_path / "chat.jsonl"
    chat_only.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cases = [
        (["bench", "--url", stub.url, *common, "--prompts", str(chat_only)], "use --endpoint chat"),
        (["bench", "--url", "ftp://x", *common], "is not a URL"),
        (["bench", "--url", stub.url, *common[:-3], "--out", str(out), "--prompts", str(tmp_path / "none.jsonl")],
         "No such file"),
        (["bench", "--url", stub.url, *common, "--tokenizer", str(tmp_path)], "no tokenizer.json"),
        (["bench", "--url", stub.url, "--model", "wrong", *common[2:]], "'wrong' is not served"),
        (["plan", "--model-size", "gpt-9", "--memory-gib", "8", "--max-len", "10"], "is not known"),
        (["plan", "--model-config", str(tmp_path / "none.json"), "--memory-gib", "8", "--max-len", "10"],
         "No such file"),
    ]
    for argv, message in cases:
        assert run_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not out.exists()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert run_cli(["bench", "--url", stub.url, *common[:-3], "--out", str(not_a_dir)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_unreachable_url_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--requests", "1",
                    "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 1 and "cannot reach" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_command_writes_reports(tmp_path: Path, stub_server: Start, capsys: pytest.CaptureFixture[str]) -> None:
    stub = stub_server(first_token_delay=0.003, token_delay=0.001, tokenize_endpoint=True)
    out = tmp_path / "bench"
    code = run_cli(["bench", "--url", stub.url + "/v1", "--model", "stub", "--concurrency", "2", "--requests", "20",
                    "--out", str(out), "--prompt-tokens", "12", "--max-tokens", "3", "--slo-ttft-p95-ms", "500",
                    "--no-progress", "--max-lag-ms", "500"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert stdout.startswith("bench: unresolved;")  # 20 requests cannot show 95% at 95% confidence
    report = json.loads((out / "bench.json").read_text())
    assert report["prompts"]["exact"] and report["prompts"]["counter"] == "server /tokenize"
    assert report["summary"]["tokens"]["prompt_target_match_fraction"] == 1.0
    assert {"requests.jsonl", "bench.md", "bench.png", "bench.json"} <= {p.name for p in out.iterdir()}


def test_capacity_command(tmp_path: Path, stub_server: Start, capsys: pytest.CaptureFixture[str]) -> None:
    stub = stub_server(first_token_delay=lambda n: 0.003 if n <= 2 else 0.5, token_delay=0.0)
    out = tmp_path / "cap"
    retry_if_starved(lambda: _check_capacity(stub, out, capsys))


def _check_capacity(stub: FakeEngine, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["capacity", "--url", stub.url, "--model", "stub", "--slo-ttft-p95-ms", "250", "--out", str(out),
                    "--settle-s", "0.2",
                    "--requests-per-probe", "60", "--max-requests-per-probe", "60", "--max-tokens", "2",
                    "--no-progress", "--max-lag-ms", "500", "--soak-minutes", "0.02", "--soak-window-s", "0.3"])
    captured = capsys.readouterr()
    assert "capacity: met; max concurrency 2; soak" in captured.out, captured.out + captured.err
    report = json.loads((out / "capacity.json").read_text())
    assert report["result"]["max_concurrency"] == 2
    # a one-second soak of a jittery stub may read "suspect" (or, rarely, "drift"): the exit code must agree
    assert code == report["exit_code"] == (1 if report["soak"]["verdict"] in ("drift", "fail", "invalid") else 0)
    assert report["soak"]["metrics"]["scrapes"] > 0
    assert {"capacity.json", "capacity.md", "capacity.png", "soak.png", "requests.jsonl"} <= {
        p.name for p in out.iterdir()}


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}))
    assert run_cli(["plan", "--model-config", str(config), "--memory-gib", "80", "--max-len", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv"]["bytes_per_token"] == 131072 and plan["weights"]["bf16_bytes"] == 16_060_522_496
    assert run_cli(["plan", "--model-size", "llama-3-70b", "--memory-gib", "24", "--max-len", "4096"]) == 1
    assert "cannot fit" in capsys.readouterr().out


def test_the_api_key_comes_from_the_gateways_variable_first(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli.loadtest import api_key_from_env

    assert api_key_from_env({"APPLIANCE_API_KEYS": " k1 , k2", "APPLIANCE_API_KEY": "old"}) == "k1"
    assert api_key_from_env({"APPLIANCE_API_KEYS": "k1", "OPENAI_API_KEY": "o"}) == "k1"
    assert capsys.readouterr().err == ""
    assert api_key_from_env({"APPLIANCE_API_KEYS": " ,", "APPLIANCE_API_KEY": "old"}) == "old"  # deprecated alias
    assert "deprecated" in capsys.readouterr().err
    assert api_key_from_env({"OPENAI_API_KEY": "o"}) == "o"
    assert api_key_from_env({}) is None


def test_the_api_key_and_metrics_token_come_from_their_files_too(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose and Kubernetes hand the appliance its secrets as files (api_keys_file, metrics_token_file): the
    load tools read the same files, first key first, comments skipped."""
    from appliance.admin_client import metrics_token
    from appliance.cli.loadtest import api_key_from_env

    keys = tmp_path / "api-keys"
    keys.write_text("# team a\n\nk-file\nk2\n")
    assert api_key_from_env({"APPLIANCE_API_KEYS_FILE": str(keys)}) == "k-file"
    assert api_key_from_env({"APPLIANCE_API_KEYS": "k-env", "APPLIANCE_API_KEYS_FILE": str(keys)}) == "k-env"
    assert api_key_from_env({"APPLIANCE_API_KEYS_FILE": str(tmp_path / "missing")}) is None
    token = tmp_path / "metrics-token"
    token.write_text("m-token\n")
    for name in ("APPLIANCE_METRICS_TOKEN", "APPLIANCE_ADMIN_TOKEN", "APPLIANCE_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("APPLIANCE_METRICS_TOKEN_FILE", str(token))
    assert metrics_token() == "m-token"
    monkeypatch.delenv("APPLIANCE_METRICS_TOKEN_FILE")
    assert metrics_token() is None
    monkeypatch.setenv("APPLIANCE_ADMIN_TOKEN", "admin")
    assert metrics_token() == "admin"  # /metrics accepts the admin token too
