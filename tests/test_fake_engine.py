"""The fake vLLM engine (tests/fake_engine.py) itself: its bytes are vLLM 0.32's, checked against vLLM's own protocol
classes (where vLLM is installed); its failures, aborts, queue and /metrics behave as documented; it runs as a
process."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.engine.load import parse_engine_load
from tests.fake_engine import CountingModel, Failure, FakeEngine, Poison, tokenize_words
from tests.polling import eventually

CHAT = {"messages": [{"role": "user", "content": "Hé, what's up?"}]}
COMPLETION = {"prompt": "Hé there"}


def post(engine: FakeEngine, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(engine.url + path, json=body, timeout=10)


def vllm_bytes(body: dict[str, Any], prompt: list[int], tokens: list[int], pieces: list[str], fp: str | None,
               cached: int | None) -> str:
    """What vLLM 0.32 writes for ``body``: its protocol classes, built with the same arguments as its
    completion_stream_generator / chat_completion_stream_generator / full generators, serialized the same way."""
    from starlette.responses import JSONResponse
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.completion import protocol as completion_protocol
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    chat, ids = "messages" in body, bool(body.get("return_token_ids"))
    options = body.get("stream_options") or {}
    include_usage, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
    details = {"completion_tokens_details": None} if chat else {}

    def usage(completion: int) -> Any:
        return UsageInfo(prompt_tokens=len(prompt), completion_tokens=completion,
                         total_tokens=len(prompt) + completion, **details)

    def final_usage() -> Any:
        final = usage(len(tokens))
        if cached is not None:
            final.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
        return final

    if not body.get("stream"):
        if chat:
            choice = chat_protocol.ChatCompletionResponseChoice(
                index=0, message=chat_protocol.ChatMessage(role="assistant", reasoning=None, content="".join(pieces)),
                logprobs=None, finish_reason="length", stop_reason=None, token_ids=tokens if ids else None,
                routed_experts=None)
            whole = chat_protocol.ChatCompletionResponse(
                id="RID", created=1, model="demo", choices=[choice], usage=final_usage(), system_fingerprint=fp,
                prompt_logprobs=None, prompt_token_ids=prompt if ids else None, prompt_text=None,
                kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        else:
            choice = completion_protocol.CompletionResponseChoice(
                index=0, text="".join(pieces), logprobs=None, finish_reason="length", stop_reason=None,
                prompt_logprobs=None, prompt_token_ids=prompt if ids else None, token_ids=tokens if ids else None,
                routed_experts=None)
            whole = completion_protocol.CompletionResponse(
                id="RID", created=1, model="demo", choices=[choice], usage=final_usage(), system_fingerprint=fp,
                kv_transfer_params=None, metrics=None)
        return JSONResponse(content=whole.model_dump()).body.decode()

    out = []
    if chat:
        first = chat_protocol.ChatCompletionStreamResponse(
            id="RID", object="chat.completion.chunk", created=1, model="demo",
            choices=[chat_protocol.ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)],
            prompt_token_ids=prompt if ids else None, prompt_text=None)
        if continuous:
            first.usage = usage(0)
        out.append(first.model_dump_json(exclude_unset=True))
    for n, token in enumerate(tokens):
        finish = "length" if n == len(tokens) - 1 else None
        chunk: Any
        if chat:
            extra = {"stop_reason": None} if finish else {}
            chunk = chat_protocol.ChatCompletionStreamResponse(
                id="RID", object="chat.completion.chunk", created=1, model="demo",
                choices=[chat_protocol.ChatCompletionResponseStreamChoice(
                    index=0, delta=DeltaMessage(content=pieces[n]), logprobs=None, finish_reason=finish,
                    token_ids=[token] if ids else None, **extra)])
        else:
            chunk = completion_protocol.CompletionStreamResponse(
                id="RID", object="text_completion", created=1, model="demo",
                choices=[completion_protocol.CompletionResponseStreamChoice(
                    index=0, text=pieces[n], logprobs=None, finish_reason=finish, stop_reason=None,
                    prompt_token_ids=prompt if ids and n == 0 else None, token_ids=[token] if ids else None)])
        if not include_usage and fp is not None and finish is not None:
            chunk.system_fingerprint = fp
        if continuous:
            chunk.usage = usage(n + 1)
        out.append(chunk.model_dump_json(exclude_unset=True))
    if include_usage:
        response = chat_protocol.ChatCompletionStreamResponse if chat else completion_protocol.CompletionStreamResponse
        last = response(id="RID", object="chat.completion.chunk" if chat else "text_completion", created=1,
                        model="demo", choices=[], usage=final_usage(), system_fingerprint=fp, metrics=None)
        out.append(last.model_dump_json(exclude_unset=chat, exclude_none=True))
    return "".join(f"data: {data}\n\n" for data in out) + "data: [DONE]\n\n"


def test_its_bytes_are_what_vllm_writes() -> None:
    """Every combination of route, streaming, token ids, usage (final, continuous), fingerprint and cached-token
    details: the same bytes as vLLM's generators, and stream_events gives what the server streams."""
    pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    with FakeEngine(response_id="RID", created=1) as engine:
        for base, ids, usage, continuous, stream, fp, cached in itertools.product(
                (COMPLETION, CHAT), (False, True), (False, True), (False, True), (False, True), ("fp", None),
                (None, 4)):
            if (continuous and not usage) or (not stream and usage):
                continue
            engine.system_fingerprint, engine.cached_tokens = fp, cached
            body: dict[str, Any] = {"model": "demo", "max_tokens": 4, "stream": stream, **base}
            if ids:
                body["return_token_ids"] = True
            if usage:
                body["stream_options"] = {"include_usage": True, "continuous_usage_stats": continuous}
            prompt = engine.prompt_ids(body)
            tokens = engine.model.generate(prompt, 4)
            pieces = [engine.model.piece(i, t) for i, t in enumerate(tokens)]
            served = post(engine, body).text
            assert served == vllm_bytes(body, prompt, tokens, pieces, fp, cached), body
            if stream:
                assert served == b"".join(engine.stream_events(body)).decode()


def test_an_engine_failure_is_vllms_error_event_then_done() -> None:
    with FakeEngine(failures=[Failure(after=2, how="error")]) as engine:
        events = post(engine, {"prompt": "x", "max_tokens": 4, "stream": True}).text.split("\n\n")
    # vLLM's create_streaming_error_response: json.dumps with its default separators
    assert events[-3:] == ['data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
                           '"param": null, "code": 500}}', "data: [DONE]", ""]
    assert len(events) == 2 + 3


def test_a_poison_is_vllms_500_whole_and_its_error_event_streamed_on_every_engine_and_continuation() -> None:
    """An input vLLM raises on (a request its engine core finishes with an error): vLLM's GenerationError answer,
    byte for byte as its handler (whole) and its stream generator (streamed) write it; after the chat's role chunk
    when streamed as chat; and a continuation whose prompt ids hold the poison's fails too."""
    pytest.importorskip("vllm.entrypoints.serve.exception_handling.error_response")
    from http import HTTPStatus

    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GenerationError

    whole = JSONResponse(create_error_response(GenerationError("Internal server error")).model_dump(), 500).body
    event = "data: " + json.dumps(create_error_response("Internal server error", err_type="InternalServerError",
                                                        status_code=HTTPStatus.INTERNAL_SERVER_ERROR).model_dump())
    poison = Poison("<<raise>>")
    with FakeEngine(poisons=[poison], tokens=4) as first, FakeEngine(poisons=[poison], tokens=4) as second:
        answer = post(first, {"prompt": "x <<raise>> y"})
        assert answer.status_code == 500 and answer.content == whole
        streamed = post(second, {"prompt": "x <<raise>> y", "stream": True}).text.split("\n\n")
        assert streamed == [event, "data: [DONE]", ""]
        chat = post(first, {"messages": [{"role": "user", "content": "<<raise>>"}], "stream": True}).text
        events = chat.split("\n\n")
        assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[1:] == [event, "data: [DONE]", ""]
        ids = first.prompt_ids({"prompt": "x <<raise>> y"})
        assert post(second, {"prompt": [*ids, 5, 6]}).status_code == 500  # a continuation of it
        assert post(second, {"prompt": "x <<rise>> y"}).status_code == 200
    assert (first.poisoned, second.poisoned) == (2, 2)


@pytest.mark.parametrize("how", ["reset", "eof", "refuse", "abort"])
def test_a_stream_dies_as_told(how: str) -> None:
    with FakeEngine(failures=[Failure(after=3, how=how)]) as engine:
        body = {"prompt": "x", "max_tokens": 8, "stream": True}
        if how in ("reset", "refuse"):
            with pytest.raises(httpx.TransportError):
                post(engine, body)
            return
        events = [e for e in post(engine, body).text.split("\n\n") if e]
        if how == "eof":
            assert len(events) == 3 and "[DONE]" not in events[-1]
        else:  # abort: the third token's chunk finishes with "abort", then [DONE]
            assert json.loads(events[2][6:])["choices"][0]["finish_reason"] == "abort"
            assert events[3:] == ["data: [DONE]"]
        assert engine.received[0].body == body and engine.streamed == 0


def test_a_client_that_hangs_up_aborts_its_request_and_frees_the_cache() -> None:
    with FakeEngine(first_token_delay=5) as engine:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(engine.url + "/v1/completions", json={"prompt": "x"}, timeout=0.3)
        eventually(lambda: engine.aborted == 1, 10, "the request aborted", interval=0.05)
        assert engine.running == 0 and engine.answered == 0 and engine._held_tokens == 0


def test_at_most_max_num_seqs_run_and_the_rest_wait_as_its_metrics_say() -> None:
    async def scenario() -> None:
        async with (FakeEngine(max_num_seqs=2, first_token_delay=0.3, block_size=1, num_gpu_blocks=100) as engine,
                    httpx.AsyncClient(base_url=engine.url, timeout=10) as client):
            body = {"prompt": "abcd", "max_tokens": 2}
            requests = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(0.15)
            load = parse_engine_load((await client.get("/metrics")).content, 0.0)
            assert (load.running, load.waiting) == (2, 1)
            assert load.kv_cache_usage == pytest.approx(2 * 4 / 100)  # two prompts held, of 100 tokens
            assert load.kv_capacity_tokens == 100
            assert [r.status_code for r in await asyncio.gather(*requests)] == [200] * 3
            load = parse_engine_load((await client.get("/metrics")).content, 0.0)
            assert (load.running, load.waiting, load.kv_cache_usage) == (0, 0, 0)
            assert (load.prompt_tokens_total, load.generation_tokens_total) == (12, 6)
            assert engine.max_running == 2

    asyncio.run(scenario())


def test_models_tokenize_and_a_model_it_does_not_serve() -> None:
    with FakeEngine(served_model_name="stub", model=CountingModel(words=True)) as engine:
        models = httpx.get(engine.url + "/v1/models").json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("stub", 4096)]
        tokens = httpx.post(engine.url + "/tokenize", json={"prompt": "two words"}).json()
        assert tokens["count"] == 3 and tokens["tokens"] == tokenize_words("two words")
        wrong = post(engine, {"model": "other", "prompt": "x"})
        assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "NotFoundError"


def test_as_a_process_it_serves_until_sigterm() -> None:
    from tests.engine.support import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_engine.py")), str(port),
                             "--model", "counting", "--tokens", "3", "--itl-ms", "1", "--uvloop"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "stream": True}).text
        assert [json.loads(e[6:])["choices"][0]["text"] for e in answer.split("\n\n")[:3]] == [" w0", " w1", " w2"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
