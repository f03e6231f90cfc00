"""A request's prompt as the engine will tokenize it: the model's own tokenizer, offline, off the event loop.

What vLLM 0.32 does, and so what this does:

- completions: a text prompt is encoded with ``add_special_tokens`` (the request's, default true: BOS); a prompt of
  token ids is taken as it is;
- chat: the messages are rendered by the tokenizer's chat template and tokenized by it (``apply_chat_template``
  with ``tokenize=True``: no special tokens beyond the template's), with the request's ``add_generation_prompt``
  (default true), ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``, ``tools`` and
  ``documents``. Text parts of a message's content are joined by newlines (vLLM's "string" content format: templates
  that iterate over content parts render differently, and then match less, never wrongly).

Requests the gateway cannot tokenize as the engine does are left to the approximate scorer: several prompts in one
request, prompt embeddings, and chat content other than text (images: their hashes are the engine's).
``cache_salt`` is read from the body as the engine will get it (after the tenants' own salt was set).

A fast tokenizer is not safe to share between threads (transformers sets truncation on the Rust object per call),
so each worker thread loads its own. They load in the background from the start (importing transformers takes
seconds, tens of seconds on a loaded host); until one has loaded, requests are routed without their tokens rather
than wait for it (``loaded``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.gateway.routing.kv_events.hashing import BlockHasher

_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template", "tools", "documents")
_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")  # what vLLM keeps of a message besides role and content
_LOADING = threading.Lock()

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PromptTokens:
    """A prompt's token ids, its cache salt, and its block keys per block size (computed once, kept for retries)."""

    ids: list[int]
    salt: str | None = None
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def keys(self, hasher: BlockHasher, block_size: int) -> list[int]:
        found = self._keys.get(block_size)
        if found is None:
            found = self._keys[block_size] = hasher.keys(self.ids, block_size, self.salt)
        return found


@dataclass(frozen=True, slots=True)
class TokenJob:
    """What to tokenize, checked on the event loop (cheap); the tokenizing itself runs in a worker."""

    salt: str | None
    ids: list[int] | None = None
    text: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    chat: dict[str, Any] = field(default_factory=dict)


class PromptTokenizer:
    """The served model's tokenizer in ``threads`` worker threads (``pool``)."""

    def __init__(self, path: Path, threads: int) -> None:
        if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer in {path}")
        self.path = path
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="appliance-tokenize")
        self._local = threading.local()
        self.loaded = threading.Event()  # a thread has its tokenizer: a request need not wait for a load
        for _ in range(threads):  # load in the background now, not on the first requests
            self.pool.submit(self._load)

    def _load(self) -> None:
        try:
            self._tokenizer()
        except Exception:  # requests stay routed without tokens; the reason is in the log
            log.exception("the tokenizer in %s did not load: prompts are routed without their tokens", self.path)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self) -> Any:
        found = getattr(self._local, "tokenizer", None)
        if found is None:
            with _LOADING:  # transformers' lazy module is not safe to import from two threads at once
                from transformers import AutoTokenizer  # seconds to import: only where precise routing is on

                found = self._local.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            self.loaded.set()
        return found

    def tokenize(self, job: TokenJob) -> list[int]:
        """In a worker thread."""
        if job.ids is not None:
            return job.ids
        tokenizer = self._tokenizer()
        if job.text is not None:
            return list(tokenizer.encode(job.text, add_special_tokens=job.add_special_tokens))
        options = dict(job.chat)
        kwargs = options.pop("chat_template_kwargs", None) or {}
        ids = tokenizer.apply_chat_template(job.messages, tokenize=True, return_dict=False, **kwargs, **options)
        return [int(token) for token in ids]


def token_job(route: str, body: dict[str, Any] | None) -> TokenJob | None:
    """The job for a request of ``route`` ("completions" or "chat"), or None when the gateway cannot tokenize it
    as the engine does."""
    if body is None or "prompt_embeds" in body:
        return None
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    if route == "completions":
        return _completion_job(body.get("prompt"), body.get("add_special_tokens", True), salt)
    if route == "chat":
        return _chat_job(body, salt)
    return None


def _completion_job(prompt: Any, special: Any, salt: str | None) -> TokenJob | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt, in a list
    if isinstance(prompt, str) and isinstance(special, bool):
        return TokenJob(salt, text=prompt, add_special_tokens=special)
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        return TokenJob(salt, ids=list(prompt))
    return None


def _chat_job(body: dict[str, Any], salt: str | None) -> TokenJob | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    rendered = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        content = _text(message.get("content"))
        if content is None:
            return None
        kept = {key: message[key] for key in _MESSAGE_KEYS if message.get(key) is not None}
        rendered.append({"role": message["role"], "content": content, **kept})
    chat: dict[str, Any] = {"add_generation_prompt": True}  # vLLM's default; transformers' is False
    chat |= {key: body[key] for key in _CHAT_OPTIONS if body.get(key) is not None}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            return None
        chat["chat_template_kwargs"] = kwargs
    return TokenJob(salt, messages=rendered, chat=chat)


def _text(content: Any) -> str | None:
    """A message's content as the template gets it; None when it holds more than text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)
