"""Prompts for load tests: synthetic ones with exact token counts (seeded), or prompts read from a JSONL file.

Prefill cost is proportional to prompt tokens, so "a 512-token prompt" has to be 512 tokens *as the server
counts them*. Token counts come, in order of preference, from a local Hugging Face tokenizer (``--tokenizer``),
the server's own ``/tokenize`` endpoint (vLLM has one; gateways usually do not), or a word count (approximate,
and the report says so). Counts include the special tokens the tokenizer adds (BOS), as the server's
``usage.prompt_tokens`` does for completions; chat templates add more, which the server-reported usage shows.

Synthetic prompts are random words, a fresh draw per request: repeating one prompt would turn every request
after the first into a prefix-cache hit and flatter TTFT.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Common English and programming words. Which of them are one token depends on the tokenizer; the factory
# measures each word's cost once and composes prompts from them.
_WORD_TEXT = """the of and to in is for that with as on be by this are or it from at an not which can you if
    will all one has have use its was but more new other used when also may each any these than only time two
    first such where must same way how then out some into value list type name file data code line set class
    function method object module string number return call first see example default error argument key
    note order should most many system test user text form part case level point state local start end next
    first last high low long short small large open close read write run make take give find keep show help
    work play turn move live hold bring begin seem feel try leave put mean tell follow stop create speak allow
    add grow offer remember love consider appear buy wait serve die send expect build stay fall cut reach
    kill remain suggest raise pass sell require report decide pull water room mother area money story fact
    month lot right study book eye job word business issue side kind head house service friend father power
    hour game member law car city community team minute idea kid body information back parent face others
    office door health person art war history party result change morning reason research girl guy moment air
    teacher force education good great little own old right big different early young important few public
    bad able true real best better sure free clear full special easy whole strong possible likely green blue
    red black white light dark simple single common"""
WORDS = tuple(_WORD_TEXT.split())


class PromptError(ValueError):
    """The prompts cannot be made or read (bad file, unreachable tokenizer); a usage error."""


class TokenCounter(Protocol):
    """Counts tokens the way the server will. ``exact`` is False for the word-count fallback."""

    name: str
    exact: bool

    def count(self, text: str) -> int: ...


@dataclass
class LocalTokenizer:
    """A Hugging Face tokenizer directory (``tokenizer.json``), read with the ``tokenizers`` library."""

    path: Path
    name: str = "local tokenizer"
    exact: bool = True
    _tok: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        file = self.path / "tokenizer.json" if self.path.is_dir() else self.path
        if not file.is_file():
            raise PromptError(f"--tokenizer {self.path}: no tokenizer.json there")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own untyped errors on a bad file
            raise PromptError(f"--tokenizer {self.path}: cannot load {file.name}: {exc}") from exc
        self.name = f"local tokenizer {file}"

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=True).ids)


@dataclass
class ServerTokenizer:
    """The server's ``POST /tokenize`` (vLLM's, body ``{"model", "prompt"}``, answer ``{"count", ...}``)."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 10.0
    name: str = "server /tokenize"
    exact: bool = True

    def count(self, text: str) -> int:
        body = json.dumps({"model": self.model, "prompt": text}).encode()
        req = urllib.request.Request(f"{self.base_url}/tokenize", data=body, method="POST",
                                     headers={"content-type": "application/json", **_auth(self.api_key)})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return int(json.loads(resp.read())["count"])


@dataclass
class WordCounter:
    """The fallback: one word, one "token". Approximate, and reports say so."""

    name: str = "word count (approximate: no tokenizer available)"
    exact: bool = False

    def count(self, text: str) -> int:
        return len(text.split())


def _auth(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def choose_counter(base_url: str, model: str, tokenizer: Path | None, api_key: str | None) -> TokenCounter:
    """An explicit ``--tokenizer`` wins; then the server's ``/tokenize``; then word counting."""
    if tokenizer is not None:
        return LocalTokenizer(tokenizer)
    server = ServerTokenizer(base_url, model, api_key)
    try:
        server.count("hello")
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return WordCounter()
    return server


@dataclass(frozen=True)
class Prompt:
    """One request's input: text (completions) or messages (chat), the output cap, and what we know of its size."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    target_tokens: int | None = None
    counted_tokens: int | None = None

    def payload(self, endpoint: str) -> dict[str, Any]:
        """The request body's input part for ``completions`` or ``chat``."""
        if endpoint == "chat":
            return {"messages": self.messages or [{"role": "user", "content": self.text or ""}]}
        if self.text is None:
            raise PromptError("this prompt has only chat messages; use --endpoint chat")
        return {"prompt": self.text}


# Prompts composed from measured word costs are checked against the tokenizer on this many samples first.
VERIFY_SAMPLE = 8


@dataclass
class SyntheticPrompts:
    """Seeded random-word prompts of exactly ``tokens`` tokens by ``counter``.

    Each word's token cost (with its leading space) is measured once and a prompt is drawn greedily from words
    that still fit. Tokenizers that split on whitespace before merging (byte-level BPE, SentencePiece) make
    such a composition exact; that is checked on a sample up front. Only when the sample disagrees is every
    prompt counted and repaired, and then ``blocking`` tells the sender to build prompts off the event loop:
    a tokenizer call (an HTTP round trip to ``/tokenize``) must never sit between a request's intended and
    actual send time. The server's reported ``prompt_tokens`` checks every request afterwards.
    Deterministic per (seed, key): the same run always sends the same prompts.
    """

    counter: TokenCounter
    tokens: int
    seed: int = 0
    max_tokens: int | None = None
    verify_each: bool = False
    _costs: dict[str, int] = field(default_factory=dict, repr=False)
    _base: int = 0

    def __post_init__(self) -> None:
        self._base = self.counter.count("")
        costs = {w: self.counter.count(" " + w) - self._base for w in dict.fromkeys(WORDS)}
        self._costs = {w: c for w, c in costs.items() if c >= 1}
        if self.tokens < self._base + 1:
            raise PromptError(f"--prompt-tokens {self.tokens} is below the {self._base + 1} the tokenizer needs")
        if not any(c == 1 for c in self._costs.values()):
            raise PromptError(f"{self.counter.name}: no single-token word to pad prompts with")
        samples = [self._compose(random.Random(f"{self.seed}:verify:{i}")) for i in range(VERIFY_SAMPLE)]
        self.verify_each = self.verify_each or any(self.counter.count(t) != self.tokens for t in samples)

    @property
    def blocking(self) -> bool:
        """True when :meth:`make` calls the tokenizer (run it in a thread, not on the event loop)."""
        return self.verify_each

    def _compose(self, rng: random.Random) -> str:
        return "".join(" " + w for w in self._draw(rng, self.tokens - self._base))

    def make(self, key: str | int) -> Prompt:
        rng = random.Random(f"{self.seed}:{key}")
        if not self.verify_each:
            return Prompt(text=self._compose(rng), max_tokens=self.max_tokens, target_tokens=self.tokens)
        words = self._draw(rng, self.tokens - self._base)
        text = "".join(" " + w for w in words)
        counted = self.counter.count(text)
        ones = sorted(w for w, c in self._costs.items() if c == 1)
        for _ in range(8):
            if counted == self.tokens:
                break
            if counted < self.tokens:
                words += [rng.choice(ones) for _ in range(self.tokens - counted)]
            else:
                words = words[: max(1, len(words) - (counted - self.tokens))]
            text = "".join(" " + w for w in words)
            counted = self.counter.count(text)
        return Prompt(text=text, max_tokens=self.max_tokens, target_tokens=self.tokens, counted_tokens=counted)

    def _draw(self, rng: random.Random, budget: int) -> list[str]:
        pool = sorted(self._costs)
        words: list[str] = []
        while budget > 0:
            word = rng.choice(pool)
            if self._costs[word] > budget:
                pool = [w for w in pool if self._costs[w] <= budget]
                continue
            words.append(word)
            budget -= self._costs[word]
        return words


@dataclass
class FilePrompts:
    """Prompts from a JSONL file, cycled in order: ``{"prompt": str}`` or ``{"messages": [...]}``, optional
    ``max_tokens``. Cycling repeats prompts once the file is exhausted, which prefix caching rewards; the
    report notes when that happened."""

    path: Path
    counter: TokenCounter | None = None
    max_tokens: int | None = None
    prompts: list[Prompt] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompts = load_jsonl_prompts(self.path, self.counter, self.max_tokens)

    def make(self, key: str | int) -> Prompt:
        index = key if isinstance(key, int) else int(str(key).rsplit(":", 1)[-1])
        return self.prompts[index % len(self.prompts)]


def load_jsonl_prompts(path: Path, counter: TokenCounter | None, max_tokens: int | None) -> list[Prompt]:
    """Parse and validate a prompts file up front, so a bad line is a usage error before any load is sent."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptError(f"--prompts {path}: {exc.strerror or exc}") from exc
    prompts = [_parse_line(path, number, line, counter, max_tokens)
               for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise PromptError(f"--prompts {path}: no prompts in the file")
    return prompts


def _parse_line(path: Path, number: int, line: str, counter: TokenCounter | None, max_tokens: int | None) -> Prompt:
    where = f"--prompts {path} line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise PromptError(f"{where}: expected an object with 'prompt' or 'messages'")
    text, messages = row.get("prompt"), row.get("messages")
    if text is None and messages is None:
        raise PromptError(f"{where}: needs 'prompt' (string) or 'messages' (list)")
    if text is not None and not isinstance(text, str):
        raise PromptError(f"{where}: 'prompt' must be a string")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise PromptError(f"{where}: 'messages' must be a list of objects")
    cap = row.get("max_tokens", max_tokens)
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise PromptError(f"{where}: 'max_tokens' must be a positive integer")
    counted = counter.count(text) if counter is not None and text is not None else None
    return Prompt(text=text, messages=messages, max_tokens=cap, counted_tokens=counted)
