"""Stream migration: a stream whose engine dies mid-way is continued on another replica, token-exact.

Why the gateway can: it relays every token, so it knows exactly what the client has already received. When a
migratable stream starts, the gateway asks vLLM for the token ids (``return_token_ids``: each streamed chunk then
carries ``token_ids``, the first one the prompt's ``prompt_token_ids``) and strips them from what the client sees
unless the client asked for them. When the stream breaks after its first byte, the continuation is a
``/v1/completions`` request on another replica whose prompt is the original prompt's token ids (for chat: the
rendered chat, as the first engine reported it) followed by the ids already sent, with ``max_tokens`` reduced by
what was sent. Its chunks are rewritten into the original stream: same id, created and model, chat chunks for a
chat request, one ``finish_reason``, usage covering the whole answer (the original prompt; every completion token).
Continuing from ids, not re-tokenized text, is what makes it exact: text does not round-trip through a tokenizer.

What cannot be continued faithfully is refused up front (``refusal``), and such a stream ends with an error event
as before migration existed:
- several choices (``n`` > 1, ``best_of``, beam search, several prompts): one stream, one continuation.
- ``seed`` with a non-zero temperature: the new engine cannot put its generator in the state the seed had reached.
  (Greedy decoding does not sample, so a seed is irrelevant there. A non-zero temperature without a seed is
  continued: each next token is still drawn from the same distribution given the same prefix, so the answer is a
  faithful sample; no engine could have reproduced the lost one anyway.)
- guided decoding, ``response_format`` other than text, tools: the grammar's state after the sent tokens would
  have to be replayed; a token-prompt continuation starts the grammar from scratch.
- ``logprobs``/``top_logprobs``/``prompt_logprobs``, ``echo``: their offsets and echoed prompt belong to the
  first request and would have to be rebuilt.
- ``stop`` strings: vLLM holds back text that may begin a stop string while its token ids are already sent; that
  text would be lost, and a stop string across the break would not be seen.
- ``presence_penalty``/``frequency_penalty``: they count output tokens only; continued, the sent tokens become
  prompt tokens and stop counting. (``repetition_penalty`` counts prompt and output alike, so it continues.)
- non-text chat content (images...): the prompt's ids hold placeholders, not the embeddings.
A stream whose chunks do not carry token ids after all (an engine that ignores the field, a reasoning parser that
hides them) is not migrated either.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway.upstream.hook import StreamBreak
from appliance.gateway.upstream.sse import DONE, payload, sse

# Why a stream broke (the label of appliance_stream_migrations_total).
CONNECTION = "connection"  # reset, or closed before [DONE]: the engine process died or dropped the connection
IDLE_TIMEOUT = "idle_timeout"  # no byte for upstream_idle_timeout_seconds: a hung engine
ENGINE_ERROR = "engine_error"  # the engine itself ended the stream with a 5xx error event (its core died)
DRAIN = "drain"  # the replica was being drained or restarted when its stream broke (a drain timeout expired)
REASONS = (CONNECTION, IDLE_TIMEOUT, ENGINE_ERROR, DRAIN)  # = metrics.MIGRATION_REASONS (tested)

# What came of it.
CONTINUED = "continued"  # another replica finished the answer
FAILED = "failed"  # the continuation could not be placed or broke too; the stream ended with an error event
INELIGIBLE = "ineligible"  # the request cannot be continued faithfully (see refusal); error event
EXHAUSTED = "exhausted"  # routing.migration_limit migrations already spent on this request; error event
OUTCOMES = (CONTINUED, FAILED, INELIGIBLE, EXHAUSTED)  # = metrics.MIGRATION_OUTCOMES (tested)

# Sampling fields carried from the original request into the continuation (a /v1/completions request); anything
# else of the original is either handled here or refused.
CARRIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words",
           "priority", "user", "cache_salt", "vllm_xargs", "stream_options")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "structured_outputs", "grammar")
STATEFUL = ("thinking_token_budget", "repetition_detection", "prompt_embeds", "suffix", "kv_transfer_params",
            "ec_transfer_params", "mm_processor_kwargs", "truncate_prompt_tokens")


def refusal(route: str, body: dict[str, Any]) -> str | None:
    """Why this request's stream cannot be continued faithfully on another engine; None when it can."""
    if _count(body.get("n")) > 1 or _count(body.get("best_of")) > 1 or body.get("use_beam_search"):
        return "several choices (n, best_of or beam search)"
    temperature = body.get("temperature")
    if body.get("seed") is not None and temperature != 0:
        return "a seed with sampling (the new engine cannot resume the seeded generator)"
    if any(body.get(key) not in (None, False, [], {}, "") for key in GUIDED):
        return "guided decoding"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "a response_format"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):
        return "stop strings (text held back for them would be lost)"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence or frequency penalty (they count output tokens only)"
    if any(body.get(key) is not None for key in STATEFUL):
        return "a parameter whose state cannot be carried over"
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
            return "several prompts"
    else:
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(part.get("type") != "text" for part in content
                                                 if isinstance(part, dict)):
                return "non-text chat content"
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


# A token chunk's ids as vLLM writes them (compact JSON). A quote inside a JSON string is escaped, so this cannot
# match inside generated text; an event where it does not match exactly once takes the parsing path.
TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')  # no optional prefix: a literal start scans 10x faster
# What only the parsing path handles: the prompt's ids (a list; vLLM writes "prompt_token_ids":null on every other
# completion chunk, which the fast path passes), an error, the final usage report, a finish. (The running usage on
# each token chunk, continuous_usage_stats, passes the fast path: it reports nothing the ledger keeps.) Plain
# substring tests: each is one fast scan, several times faster than one regular expression with alternatives.
SLOW_MARKS = (b'"prompt_token_ids":[', b'"error"', b'"choices":[],"usage":{', b'"finish_reason":"')


_PROMPT_IDS, _ERROR, _USAGE_REPORT, _FINISH = SLOW_MARKS


def needs_parsing(events: bytes) -> bool:
    # the marks spelled out rather than any() over them: a generator per event cost more than the four scans
    return (_PROMPT_IDS in events or _ERROR in events or _USAGE_REPORT in events or _FINISH in events)


@dataclass
class StreamLedger:
    """What the client has been sent of one stream, kept from the events as they are relayed, and how to rewrite a
    continuation's events into that stream."""

    route: str  # "completions" or "chat"
    body: dict[str, Any]  # the client's request
    max_model_len: int | None = None
    client_wants_ids: bool = False  # the client asked for return_token_ids itself: ids stay in its chunks
    prompt_ids: list[int] | None = None
    sent_ids: list[int] = field(default_factory=list)
    stream_id: str | None = None  # id, created, model, as the client first saw them
    created: int | None = None
    model: str | None = None
    finish_reason: str | None = None
    usage_sent: bool = False
    done: bool = False  # [DONE] relayed
    trackable: bool = True  # every token-bearing chunk carried its ids
    continuing: bool = False  # the current upstream leg is a continuation (completions protocol)
    sent_before_leg: int = 0  # tokens sent before the current leg started
    events: int = 0  # events relayed to the client
    aborted: bool = False  # the engine finished the current leg with "abort": the client did not ask for that

    def __post_init__(self) -> None:
        self.client_wants_ids = bool(self.body.get("return_token_ids"))
        prompt = self.body.get("prompt")
        if self.route == "completions" and isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                self.prompt_ids = list(prompt)
            elif isinstance(first, list) and len(prompt) == 1:
                self.prompt_ids = list(first)

    # -- relaying -----------------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """The client has been sent at least one event of this stream."""
        return self.events > 0

    def accept(self, event: bytes) -> bytes:
        """One whole upstream event of the current leg in; the bytes to send the client out. Raises StreamBreak
        for an engine's 5xx error event (the engine failed, the request did not). A chunk that finishes with
        "abort" (the engine aborted the request: it was shutting down, since the client is still here) is sent
        without that finish and sets ``aborted``: the caller then treats the leg as broken."""
        if self.events and not self.continuing:
            fast = self._fast(event)
            if fast is not None:
                self.events += 1
                return fast
        data = payload(event)
        self.events += 1
        if data is None:
            return event
        if data == b"[DONE]":
            self.done = True
            return DONE
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj and "choices" not in obj:
            error = obj.get("error") or {}
            code = error.get("code") if isinstance(error, dict) else None
            if not isinstance(code, int) or code >= 500:
                self.events -= 1  # not relayed
                raise StreamBreak(ENGINE_ERROR, str(error.get("message") if isinstance(error, dict) else error),
                                  status=code if isinstance(code, int) else None)
            return event
        return self._continued(obj) if self.continuing else self._original(obj, event)

    def accept_block(self, events: bytes) -> bytes | None:
        """Whole events of the original leg in, the client's bytes out, in one pass when every one of them is a
        plain token chunk (the bulk of a stream: a loaded gateway reads several per read): their ids recorded and,
        unless the client asked for them, nulled, as vLLM writes them unasked. None: take the event-by-event
        path (the first event, a continuation, anything ``SLOW_MARKS`` finds, an event without exactly one
        ``token_ids``)."""
        if not self.events or self.continuing or needs_parsing(events):
            return None
        count = events.count(b"\n\n")
        found = TOKEN_IDS.findall(events)
        if (len(found) != count or events.count(b'"token_ids"') != count or events.count(b"data: {") != count
                or not events.endswith(b"\n\n")):
            return None
        ids = b",".join(group for group in found if group)
        if ids:
            self.sent_ids.extend(map(int, ids.split(b",")))
        self.events += count
        return events if self.client_wants_ids else TOKEN_IDS.sub(b'"token_ids":null', events)

    def _fast(self, event: bytes) -> bytes | None:
        """A plain token chunk of the original leg, without parsing it (the bulk of a stream: one per token): its
        ids recorded and, unless the client asked for them, cut out of the bytes. None: take the parsing path."""
        if not event.startswith(b"data: {") or needs_parsing(event):
            return None
        found = TOKEN_IDS.search(event)
        if found is None or event.find(b'"token_ids"', found.end()) >= 0:
            return None
        ids = found.group(1)
        if ids:
            self.sent_ids.extend(int(t) for t in ids.split(b","))
        if self.client_wants_ids:
            return event
        return event[:found.start(1) - 1] + b"null" + event[found.end(1) + 1:]

    def _original(self, obj: dict[str, Any], event: bytes) -> bytes:
        if self.events == 1:
            self.stream_id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        changed = self._take_prompt_ids(obj)  # chat: on the first chunk
        for choice in obj.get("choices") or []:
            changed |= self._track(choice)
        if obj.get("usage") and not obj.get("choices"):  # the final usage event, not a chunk's running usage
            self.usage_sent = True
        if not changed:
            return event
        return sse(obj)

    def _take_prompt_ids(self, holder: dict[str, Any]) -> bool:
        """Record the prompt's ids where vLLM puts them (the chunk for chat, the choice for completions); strip them
        unless the client asked (to null: vLLM writes the field as null when nobody asked). True if ``holder``
        changed."""
        if holder.get("prompt_token_ids") is None:
            return False
        self._prompt(holder["prompt_token_ids"])
        if self.client_wants_ids:
            return False
        holder["prompt_token_ids"] = None
        return True

    def _track(self, choice: dict[str, Any]) -> bool:
        """Record one choice's tokens and finish; strip the ids the client did not ask for. True if changed."""
        changed = self._take_prompt_ids(choice)  # completions: on the first chunk
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.sent_ids.extend(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            self.trackable = False  # text without its ids: what was sent can no longer be known exactly
        if ids is not None and not self.client_wants_ids:
            choice["token_ids"] = None  # as vLLM writes it when nobody asked
            changed = True
        if choice.get("finish_reason") == "abort":
            choice["finish_reason"] = None
            self.aborted = True
            return True
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return changed

    def _prompt(self, ids: Any) -> None:
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = list(ids)

    def _continued(self, obj: dict[str, Any]) -> bytes:
        """A continuation's text_completion chunk rewritten as a chunk of the client's stream."""
        out: dict[str, Any] = {"id": self.stream_id,
                               "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
                               "created": self.created, "model": self.model, "choices": []}
        for choice in obj.get("choices") or []:
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.sent_ids.extend(ids)
            else:
                self.trackable = False
            finish = choice.get("finish_reason")
            if finish == "abort":
                finish, self.aborted = None, True
            if finish is not None:
                self.finish_reason = finish
            shown = ids if self.client_wants_ids and isinstance(ids, list) else None
            if self.route == "chat":  # vLLM's chat chunk: stop_reason on the finishing one only
                rewritten: dict[str, Any] = {"index": 0, "delta": {"content": choice.get("text") or ""},
                                             "logprobs": None, "finish_reason": finish}
                if finish is not None:
                    rewritten["stop_reason"] = choice.get("stop_reason")
                rewritten["token_ids"] = shown
            else:  # vLLM's completion chunk: every field, null when unset
                rewritten = {"index": 0, "text": choice.get("text") or "", "logprobs": None, "finish_reason": finish,
                             "stop_reason": choice.get("stop_reason"), "prompt_token_ids": None, "token_ids": shown}
            out["choices"].append(rewritten)
        if obj.get("usage"):  # the final usage, or a chunk's running usage: the whole answer's so far
            out["usage"] = self.whole_usage(obj["usage"].get("completion_tokens") or 0)
            self.usage_sent = self.usage_sent or not out["choices"]
        return sse(out)

    def whole_usage(self, leg_completion_tokens: int) -> dict[str, int]:
        """Usage covering the whole answer: the original prompt, and every completion token of every leg."""
        prompt = len(self.prompt_ids or [])
        completion = self.sent_before_leg + leg_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- continuing ---------------------------------------------------------------------------------------------

    def continuable(self) -> bool:
        """The ids of everything sent are known (or nothing was sent: the request can simply be sent again)."""
        if not self.started:
            return True
        return self.trackable and self.prompt_ids is not None

    def max_tokens(self) -> int | None:
        """The original request's own completion-token limit (vLLM's defaults when it gave none)."""
        given = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if given:
            return int(given)
        if self.route == "completions":
            return 16  # vLLM's CompletionRequest default
        if self.max_model_len is not None and self.prompt_ids is not None:
            return self.max_model_len - len(self.prompt_ids)
        return None

    def remaining(self) -> int | None:
        limit = self.max_tokens()
        return None if limit is None else limit - len(self.sent_ids)

    def finished(self) -> bool:
        """The answer is complete; only the closing events (usage, [DONE]) may be missing."""
        remaining = self.remaining()
        return self.finish_reason is not None or (self.started and remaining is not None and remaining <= 0)

    def closing(self) -> bytes:
        """The events a finished stream still owes the client: a finish, its usage if asked for, [DONE]."""
        out = b""
        if self.finish_reason is None:
            self.finish_reason = "length"
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            if self.route == "chat":
                choice["delta"] = {}
            else:
                choice["text"] = ""
            out += sse({"id": self.stream_id, "object": self._object(), "created": self.created,
                        "model": self.model, "choices": [choice]})
        if self._wants_usage() and not self.usage_sent:
            self.sent_before_leg = len(self.sent_ids)
            out += sse({"id": self.stream_id, "object": self._object(), "created": self.created,
                        "model": self.model, "choices": [], "usage": self.whole_usage(0)})
            self.usage_sent = True
        self.done = True
        return out + DONE

    def continuation(self) -> tuple[str, bytes]:
        """The next leg's path and body: the original request again when the client has seen nothing yet;
        otherwise a /v1/completions request for the rest, from token ids. Switches the ledger to that leg."""
        if not self.started:
            self.continuing = False
            body = dict(self.body, return_token_ids=True)
            return ("/v1/chat/completions" if self.route == "chat" else "/v1/completions"), _dumps(body)
        assert self.prompt_ids is not None
        body = {key: self.body[key] for key in CARRIED if key in self.body}
        if "model" in self.body:
            body["model"] = self.body["model"]
        body.update(prompt=self.prompt_ids + self.sent_ids, stream=True, return_token_ids=True)
        remaining = self.remaining()
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = self.body.get("min_tokens")
        if min_tokens:
            body["min_tokens"] = max(0, int(min_tokens) - len(self.sent_ids))
        self.continuing = True
        self.sent_before_leg = len(self.sent_ids)
        return "/v1/completions", _dumps(body)

    def _wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def _object(self) -> str:
        return "chat.completion.chunk" if self.route == "chat" else "text_completion"


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def with_token_ids(body: bytes) -> bytes:
    """The client's request bytes asking the engine for token ids too (the last key wins in vLLM's parser, so an
    explicit ``false`` from the client is overridden; its chunks get the ids stripped again)."""
    end = body.rstrip().rfind(b"}")
    head = body[:end].rstrip()
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + b'"return_token_ids":true}'
