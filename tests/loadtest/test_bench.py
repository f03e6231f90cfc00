"""The load generator against a stub streaming server: per-request timings, phases, the open loop's rate,
coordinated-omission accounting, client-bottleneck refusal, errors, prompts and preflight checks."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.loadtest.bench import (
    SLO,
    BenchError,
    Target,
    bench_exit_code,
    bench_report,
    execute,
    normalize_base_url,
    summarize_run,
)
from appliance.loadtest.client import RequestResult, chunk_text
from appliance.loadtest.load import LoadRun, LoadSpec, run_load
from appliance.loadtest.prompts import (
    FilePrompts,
    LocalTokenizer,
    PromptError,
    ServerTokenizer,
    SyntheticPrompts,
    WordCounter,
    choose_counter,
)
from tests.fake_engine import FakeEngine
from tests.loadtest.timing import retry_if_starved

Start = Callable[..., FakeEngine]
LENIENT = 0.5  # max_lag_s for tests that do not test the lag rule: the test machine is shared and busy


def _run(target: Target, spec: LoadSpec, prompts: object | None = None, **kw: object) -> LoadRun:
    prompts = prompts or SyntheticPrompts(WordCounter(), 16, 0, kw.pop("max_tokens", 6))  # type: ignore[arg-type]
    return asyncio.run(execute(target, spec, prompts, **kw))  # type: ignore[arg-type]


# --- derived timings on synthetic numbers --------------------------------------------------------------------


def test_request_result_derivations() -> None:
    r = RequestResult(index=0, phase="measure", intended=1.0, sent=1.5, first_token=2.0, end=2.3,
                      chunk_times=[2.0, 2.1, 2.3], status=200, completion_tokens=3)
    assert r.queue == pytest.approx(0.5)
    assert r.ttft == pytest.approx(1.0)  # from the intended send time, not from 1.5
    assert r.e2e == pytest.approx(1.3)
    assert r.itl == pytest.approx([0.1, 0.2])
    assert r.tpot == pytest.approx((1.3 - 1.0) / (3 - 1))
    r.completion_tokens = None  # no usage: chunks count tokens
    assert r.output_tokens == 3
    failed = RequestResult(index=1, phase="measure", intended=0.0, sent=0.0, end=1.0, status=500, error="HTTP 500")
    assert not failed.ok and failed.e2e is None and failed.tpot is None


def test_chunk_text_completion_and_chat() -> None:
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("http://h:8000") == "http://h:8000"
    with pytest.raises(BenchError) as exc:
        normalize_base_url("h:8000")
    assert exc.value.exit_code == 2


# --- against the stub ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_timings_of_a_scripted_stream(stub_server: Start, endpoint: str) -> None:
    stub = stub_server(first_token_delay=0.10, token_delay=0.02)
    target = Target(stub.url, "stub", endpoint=endpoint)
    retry_if_starved(lambda: _check_timings(_run(target, LoadSpec(concurrency=1, requests=4, warmup=1,
                                                                  max_lag_s=LENIENT), max_tokens=6)))
    body = stub.received[-1].body
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert ("messages" in body) == (endpoint == "chat")


def _check_timings(run: LoadRun) -> None:
    measured = run.measured
    assert [r.index for r in measured] == [1, 2, 3, 4]
    # Lower bounds are exact (the stub sleeps at least that long); upper bounds leave room for a busy machine.
    for r in measured:
        assert r.ok and r.completion_tokens == 6 and len(r.chunk_times) == 6 and len(r.itl) == 5
        assert 0.10 <= r.ttft < 0.25  # chat's role-only first chunk must not count as the first token
        assert r.first_token == r.chunk_times[0]
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)
        assert r.e2e == pytest.approx(r.ttft + sum(r.itl) + (r.end - r.chunk_times[-1]))
        assert 0.20 <= r.e2e < 0.45
        assert r.queue < 0.05
    assert 0.018 <= statistics.median(gap for r in measured for gap in r.itl) < 0.05
    assert 0.018 <= statistics.median(r.tpot for r in measured) < 0.05


def test_warmup_and_cooldown_are_excluded(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.005, token_delay=0.001)
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=3, requests=12, warmup=3, max_lag_s=LENIENT))
    assert [r.index for r in run.measured] == list(range(3, 15))
    phases = {r.phase for r in run.results}
    assert "warmup" in phases
    assert len(stub.received) >= 15  # cool-down requests kept the load up while the last measured ones ran
    summary = summarize_run(run)
    assert summary["requests"] == 12 and summary["succeeded"] == 12
    assert summary["throughput"]["mean_in_flight"] == pytest.approx(3, rel=0.35)


def test_open_loop_poisson_rate(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.002, token_delay=0.001)
    spec = LoadSpec(rate=RATE, requests=120, warmup=0, seed=3, max_lag_s=LENIENT)
    retry_if_starved(lambda: _check_rate(_run(Target(stub.url, "stub"), spec, max_tokens=2), RATE))


RATE = 60.0


def _check_rate(run: LoadRun, rate: float) -> None:
    intended = sorted(r.intended for r in run.measured)
    gaps = [b - a for a, b in zip(intended, intended[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.2)  # 119 exponential gaps: s.e. of the mean 9%
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.3)  # exponential: stdev equals the mean
    sent = [r.sent - r.intended for r in run.measured]
    assert statistics.median(sent) < 0.01  # sent on schedule
    window = max(r.intended for r in run.measured) - min(r.intended for r in run.measured)
    assert len(run.measured) / window == pytest.approx(rate, rel=0.25)


def test_open_loop_schedule_is_seeded(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.001, token_delay=0.0)
    spec = LoadSpec(rate=200.0, requests=20, warmup=0, seed=11, max_lag_s=LENIENT)
    first = _run(Target(stub.url, "stub"), spec, max_tokens=1)
    second = _run(Target(stub.url, "stub"), spec, max_tokens=1)
    gaps = [[b.intended - a.intended for a, b in zip(run.measured, run.measured[1:], strict=False)]
            for run in (first, second)]
    assert gaps[0] == pytest.approx(gaps[1], abs=1e-9)


def test_stalled_server_shows_in_latency_from_intended_time(stub_server: Start) -> None:
    """Coordinated omission: with one connection, requests due during a 0.6 s stall wait in the client. Timed
    from when they went on the wire they look fast; timed from when they were due they carry the stall."""
    stub = stub_server(first_token_delay=0.005, token_delay=0.001, freeze_at=4, freeze_seconds=0.6)
    spec = LoadSpec(rate=20.0, requests=24, warmup=0, max_inflight=1, seed=5, max_lag_s=LENIENT)

    def check() -> None:
        stub.received.clear()  # the stall is at the 4th arrival of each attempt
        _check_stall(_run(Target(stub.url, "stub"), spec, max_tokens=2))

    retry_if_starved(check)


def _check_stall(run: LoadRun) -> None:
    measured = run.measured
    from_intended = [r.e2e for r in measured]
    from_send = [r.end - r.sent for r in measured]
    assert max(from_intended) >= 0.5
    slow_from_intended = sum(v > 0.2 for v in from_intended)
    slow_from_send = sum(v > 0.2 for v in from_send)
    assert slow_from_intended >= 5  # the backlog the stall built
    # Seen naively only the stalled request itself is slow (plus, on a loaded machine, a straggler or two).
    assert slow_from_send <= slow_from_intended - 3, (slow_from_send, slow_from_intended)
    queued = [r for r in measured if r.queue > 0.2]
    assert len(queued) >= 4
    summary = summarize_run(run)
    assert summary["latency_s"]["queue"]["max"] >= 0.2  # the client's own queue time is reported
    assert summary["latency_s"]["e2e"]["p95"] > 0.3 > summary["latency_s"]["ttft_from_send"]["p95"]
    for r in queued:  # waiting for a connection slot is queue time, not scheduler lag
        assert r.dispatched - r.intended < 0.1 < 0.2 < r.queue


def test_client_bottleneck_refuses_to_report() -> None:
    """A send that blocks the event loop (a CPU-starved client) makes arrivals late: the run is refused."""

    async def blocking_send(result: RequestResult) -> RequestResult:
        result.sent = time.perf_counter() - origin
        time.sleep(0.03)  # synchronous on purpose: the loop cannot keep a 10 ms schedule
        result.first_token = result.end = time.perf_counter() - origin
        result.chunk_times, result.status = [result.first_token], 200
        return result

    origin = time.perf_counter()
    spec = LoadSpec(rate=100.0, requests=20, warmup=0, max_lag_s=0.05)
    run = asyncio.run(run_load(spec, blocking_send, lambda: time.perf_counter() - origin))
    reason = run.client_bottleneck()
    assert reason is not None and "fell behind" in reason
    report = bench_report(Target("http://127.0.0.1:1", "m"), spec, run, None, {})
    assert report["valid"] is False and report["summary"] is None and report["verdict"] == "invalid"
    assert bench_exit_code(report) == 1


def test_errors_count_against_the_sla(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.002, token_delay=0.0, fail_every=4)
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=2, requests=40, warmup=0, max_lag_s=LENIENT),
               max_tokens=2)
    summary = summarize_run(run, SLO(ttft_s=1.0))
    errors = summary["errors"]
    assert 6 <= errors["count"] <= 14 and errors["by_kind"] == {"HTTP 500": errors["count"]}
    assert "injected failure" in errors["examples"][0]
    decision = summary["sla"]["decisions"]["ttft"]
    assert decision["successes"] == summary["succeeded"] < decision["n"] == 40
    assert summary["sla"]["verdict"] == "fail"
    assert summary["goodput"]["fraction"] == pytest.approx(summary["succeeded"] / 40)


def test_duration_mode(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.01, token_delay=0.001)
    spec = LoadSpec(concurrency=2, duration=0.6, warmup=2, max_lag_s=LENIENT)

    def check() -> None:
        run = _run(Target(stub.url, "stub"), spec, max_tokens=2)
        start = run.measure_start
        assert start is not None and all(start <= r.intended < start + 0.6 for r in run.measured)
        assert 20 <= len(run.measured) <= 120

    retry_if_starved(check)


# --- prompts ---------------------------------------------------------------------------------------------------


def test_server_tokenizer_gives_exact_prompts(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.002, token_delay=0.0, tokenize_endpoint=True)
    counter = choose_counter(stub.url, "stub", None, None)
    assert isinstance(counter, ServerTokenizer)
    prompts = SyntheticPrompts(counter, 20, seed=1, max_tokens=2)
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=2, requests=10, warmup=0, max_lag_s=LENIENT),
               prompts)
    summary = summarize_run(run)
    assert summary["tokens"]["prompt_target_match_fraction"] == 1.0  # server usage agrees: 20 tokens each


def test_word_counter_fallback_without_tokenize(stub_server: Start) -> None:
    stub = stub_server()
    counter = choose_counter(stub.url, "stub", None, None)
    assert isinstance(counter, WordCounter) and not counter.exact


def _train_tokenizer(path: Path) -> Path:
    """A small byte-level BPE (with a BOS post-processor), trained in milliseconds, like the demo model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [("the quick brown fox jumps over the lazy dog and returns a value of the function " * 3)] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    return path


def test_local_tokenizer_exact_and_seeded(tmp_path: Path) -> None:
    counter = LocalTokenizer(_train_tokenizer(tmp_path))
    for n in (2, 7, 64, 300):
        prompts = SyntheticPrompts(counter, n, seed=4)
        made = [prompts.make(i) for i in range(5)]
        assert all(p.target_tokens == n and p.counted_tokens in (None, n) for p in made)
        assert all(counter.count(p.text) == n for p in made)
        if n > 2:  # a fresh draw per request (no shared prefix cache); a 1-word prompt has few choices
            assert len({p.text for p in made}) == 5
        assert prompts.make(3) == made[3]  # and reproducible
    with pytest.raises(PromptError, match="below"):
        SyntheticPrompts(counter, 1)


def test_prompt_file(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "hello there"}\n\n{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n')
    source = FilePrompts(good, WordCounter(), 8)
    assert source.make(0).payload("completions") == {"prompt": "hello there"}
    assert source.make(3).max_tokens == 3 and source.make(2).counted_tokens == 2
    with pytest.raises(PromptError, match="use --endpoint chat"):
        source.make(1).payload("completions")
    for line, message in [("not json", "line 1: not JSON"), ('{"x": 1}', "needs 'prompt'"),
                          ('{"prompt": "a", "max_tokens": 0}', "positive integer"), ("[1]", "expected an object")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(PromptError, match=message):
            FilePrompts(bad)


# --- preflight -------------------------------------------------------------------------------------------------


def test_preflight_wrong_model_is_usage_error(stub_server: Start) -> None:
    stub = stub_server()
    with pytest.raises(BenchError) as exc:
        _run(Target(stub.url, "other"), LoadSpec(concurrency=1, requests=1), check=True)
    assert exc.value.exit_code == 2 and "'other' is not served" in str(exc.value)


def test_preflight_unreachable_is_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchError) as exc:
        _run(Target(f"http://127.0.0.1:{port}", "m"), LoadSpec(concurrency=1, requests=1), check=True)
    assert exc.value.exit_code == 1 and "cannot reach" in str(exc.value)


def test_rows_are_json(stub_server: Start) -> None:
    stub = stub_server(first_token_delay=0.001, token_delay=0.0)
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=1, requests=2, warmup=0, max_lag_s=LENIENT))
    row = json.loads(json.dumps(run.measured[0].as_row()))
    assert {"ttft_s", "tpot_s", "e2e_s", "queue_s", "itl_s", "chunk_times_s", "prompt_tokens"} <= set(row)


class _CharCounter:
    """Tokens by characters (one per 4): word costs do not add up, so every prompt must be counted."""

    name, exact = "chars", True

    def count(self, text: str) -> int:
        return 1 + len(text) // 4


def test_non_additive_tokenizer_counts_every_prompt() -> None:
    prompts = SyntheticPrompts(_CharCounter(), 40, seed=2)  # type: ignore[arg-type]
    assert prompts.verify_each and prompts.blocking  # the sender builds these prompts in a thread
    for key in range(10):
        p = prompts.make(key)
        assert p.counted_tokens == _CharCounter().count(p.text)
        assert abs(p.counted_tokens - 40) <= 3


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_a_failing_send_is_raised_not_hung(mode: str) -> None:
    async def broken(result: RequestResult) -> RequestResult:
        raise PromptError("this prompt has only chat messages; use --endpoint chat")

    spec = LoadSpec(concurrency=2, requests=5) if mode == "closed" else LoadSpec(rate=50.0, requests=5)
    with pytest.raises(PromptError):
        asyncio.run(asyncio.wait_for(run_load(spec, broken, time.perf_counter), 5))


def test_malformed_stream_is_an_error_not_a_crash(stub_server: Start) -> None:
    stub = stub_server(raw_stream=b"data: [1, 2]\n\ndata: [DONE]\n\n")
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=1, requests=2, warmup=0, max_lag_s=LENIENT))
    assert all(not r.ok and "not a JSON object" in (r.error or "") for r in run.measured)


def test_stream_error_event_and_empty_stream(stub_server: Start) -> None:
    stub = stub_server(raw_stream=b'data: {"error": {"message": "engine dead"}}\n\n')
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=1, requests=1, warmup=0, max_lag_s=LENIENT))
    assert run.measured[0].error == "stream error: engine dead"
    stub.raw_stream = b"data: [DONE]\n\n"
    run = _run(Target(stub.url, "stub"), LoadSpec(concurrency=1, requests=1, warmup=0, max_lag_s=LENIENT))
    assert run.measured[0].error == "stream ended without content"
