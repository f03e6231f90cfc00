"""A tiny Llama built offline, so the appliance can serve *something* with no model hub.

The appliance must start on an air-gapped laptop or CI runner, where nothing can be downloaded. So the demo
model is trained from scratch on text that ships with every CPython: ``pydoc_data.topics`` (the reference
manual's topic pages). The result is a real Hugging Face ``LlamaForCausalLM`` checkpoint in bfloat16 that
``transformers`` and vLLM load like any other, small enough to train in about a minute on two CPU cores, and
shaped so the INT8 quantizer has something meaningful to shrink:

* hidden 256, 4 layers, 4 heads of 64 (vLLM's CPU attention supports head_dim 64), 2 KV heads (GQA),
  MLP 768, vocab 2048, tied embeddings. The decoder Linears hold ~86% of the parameters, so INT8 weights
  bring the checkpoint to ~57% of its bf16 size.
* a byte-level BPE tokenizer trained on the same text (any input round-trips; no unknown bytes).

The build is deterministic for a given ``seed`` (and CPython's topic text) whenever it reaches the step cap
before the wall-clock budget; the budget exists so a slow or busy host still finishes in bounded time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from appliance.files import replace_folder

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

# --- shape -------------------------------------------------------------------------------------------------
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 768
VOCAB_SIZE = 2048
MAX_POSITIONS = 1024

# --- special tokens (Llama's conventional ids: unk 0, bos 1, eos 2) -----------------------------------------
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

# --- training ------------------------------------------------------------------------------------------------
SEQ_LEN = 128
BATCH_SIZE = 4
# Sized so an idle 2-core host reaches the cap inside the default 60 s budget (~0.11 s/step: ~45 s),
# which is what makes the default build reproducible; a busier host stops on time instead.
DEFAULT_MAX_STEPS = 400
PEAK_LR = 1e-3
MIN_LR_FRACTION = 0.1
WARMUP_FRACTION = 0.06
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0

# Every 20th page (sorted by key, offset 10) is held out: 4 of 78 pages (~2% of the text), never trained on, so the
# quantizer's quality check measures generalisation rather than memorisation.
HOLDOUT_EVERY = 20
HOLDOUT_OFFSET = 10

# A deliberately plain template: the model never saw chat data, but vLLM's /v1/chat/completions refuses to
# serve a tokenizer without one. It starts with BOS because vLLM renders chat prompts without adding
# special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class DemoModelError(ValueError):
    """The demo model cannot be built where asked (for example the target directory is in use)."""


# --- text ------------------------------------------------------------------------------------------------------


def _topic_split() -> tuple[list[str], list[str]]:
    """Split the topic pages into (training, held-out) by sorted key, so the split never depends on dict order.

    Some keys share one page (``if`` and ``else``); pages are deduplicated first so a held-out page can never
    also be a training page.
    """
    from pydoc_data.topics import topics

    pages = list(dict.fromkeys(topics[k] for k in sorted(topics)))
    train = [page for i, page in enumerate(pages) if i % HOLDOUT_EVERY != HOLDOUT_OFFSET]
    heldout = [page for i, page in enumerate(pages) if i % HOLDOUT_EVERY == HOLDOUT_OFFSET]
    return train, heldout


def training_documents() -> list[str]:
    """The topic pages the demo model (and its tokenizer) are trained on."""
    return _topic_split()[0]


def heldout_documents() -> list[str]:
    """The topic pages kept out of training, for quality checks."""
    return _topic_split()[1]


def training_text() -> str:
    """All training pages as one string (pages separated by a blank line)."""
    return "\n\n".join(training_documents())


def heldout_text() -> str:
    """All held-out pages as one string; the quantizer's default evaluation text."""
    return "\n\n".join(heldout_documents())


# --- tokenizer -------------------------------------------------------------------------------------------------


def train_tokenizer(documents: list[str]) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) so every string encodes without unknowns and decodes back exactly.

    Encoding prepends BOS, matching what Llama tokenizers do, so prompts sent to vLLM's /v1/completions look
    like the training sequences (which start after a BOS or EOS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    for token, expected in zip(SPECIAL_TOKENS, (UNK_ID, BOS_ID, EOS_ID, PAD_ID), strict=True):
        if tokenizer.token_to_id(token) != expected:  # the trainer assigns specials first; guard the contract
            raise RuntimeError(f"tokenizer put {token} at id {tokenizer.token_to_id(token)}, expected {expected}")
    return tokenizer


def _write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write the files AutoTokenizer and vLLM look for, with the chat template inside tokenizer_config.json."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


# --- model -----------------------------------------------------------------------------------------------------


def demo_config() -> LlamaConfig:
    """The demo model's LlamaConfig (see the module docstring for why this shape)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _encode_documents(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """One long token stream: BOS page EOS BOS page EOS ..., so the model learns where text starts and stops."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)  # already starts with BOS (post-processor)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def _lr_at(step: int, max_steps: int) -> float:
    """Linear warmup then cosine decay to MIN_LR_FRACTION of the peak, as a function of the step alone.

    Tied to the step (not the clock) so a run that reaches the cap is reproducible.
    """
    warmup = max(1, int(max_steps * WARMUP_FRACTION))
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def _next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` [B, T+1]."""
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def _heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor) -> float:
    """Mean loss over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    n = (len(stream) - 1) // SEQ_LEN
    windows = torch.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])
    losses = [
        _next_token_loss(model, windows[i : i + BATCH_SIZE]).item() * len(windows[i : i + BATCH_SIZE])
        for i in range(0, n, BATCH_SIZE)
    ]
    return sum(losses) / n


def _train(model: LlamaForCausalLM, stream: torch.Tensor, *, max_steps: int, deadline: float,
           seed: int) -> tuple[int, float]:
    """Train on random windows of ``stream`` until ``max_steps`` or ``deadline``; return (steps, recent loss)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ_LEN + 1)
    recent: list[float] = []
    model.train()
    step = 0
    while step < max_steps and time.monotonic() < deadline:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, max_steps)
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE,), generator=generator)
        loss = _next_token_loss(model, stream[starts[:, None] + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-10:]
        step += 1
    return step, sum(recent) / max(1, len(recent))


# --- build -----------------------------------------------------------------------------------------------------


def build_demo_model(
    out_dir: Path,
    *,
    train_seconds: float = 60.0,
    seed: int = 0,
    max_steps: int = DEFAULT_MAX_STEPS,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train the demo model and write it to ``out_dir`` as a bf16 Hugging Face checkpoint.

    The checkpoint is assembled in a hidden sibling directory and renamed into place only when complete, so
    a crash or Ctrl-C never leaves a half-written model that a later ``appliance up`` would try to serve.
    Raises DemoModelError if ``out_dir`` already holds files, unless ``overwrite`` is true.

    Returns a summary: parameter count, checkpoint bytes, steps, losses, seconds, and whether the step cap
    (hence a reproducible result) was reached.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    started = time.monotonic()
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out_dir)
    try:
        tmp.mkdir()
    except OSError as exc:  # name the folder the user asked for, not the temporary beside it
        raise OSError(exc.errno, f"cannot create {out_dir}: {exc.strerror}") from exc
    try:
        train_docs, heldout_docs = _topic_split()
        tokenizer = train_tokenizer(train_docs)
        train_stream = _encode_documents(tokenizer, train_docs)
        heldout_stream = _encode_documents(tokenizer, heldout_docs)

        threads = available_cores()
        with _cpu_threads(threads), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(demo_config()).float()
            deadline = time.monotonic() + train_seconds
            steps, train_loss = _train(model, train_stream, max_steps=max_steps, deadline=deadline, seed=seed)
            heldout_loss = _heldout_loss(model, heldout_stream)

        model.to(torch.bfloat16)
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        model.save_pretrained(tmp)
        _write_tokenizer(tokenizer, tmp)
        make_readable(tmp)
        weights_bytes = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "path": str(out_dir),
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": weights_bytes,
        "train_steps": steps,
        "max_steps": max_steps,
        "reached_step_cap": steps >= max_steps,
        "train_tokens": len(train_stream),
        "threads": threads,
        "final_train_loss": round(train_loss, 4),
        "heldout_loss": round(heldout_loss, 4),
        "seconds": round(time.monotonic() - started, 2),
    }


# --- filesystem helpers (shared with the quantizer) ------------------------------------------------------------


def _check_target(out_dir: Path, *, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoModelError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise DemoModelError(f"{out_dir} already exists and is not empty; pass overwrite=True to replace it")


def temp_sibling(target: Path) -> Path:
    """A hidden directory next to ``target`` (same filesystem, so the final rename is atomic)."""
    return target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def available_cores() -> int:
    """Cores this process may run on (affinity aware) that other processes are not keeping busy right now.

    Oversubscribing OpenMP threads is far worse than using fewer: with a vLLM engine busy on a 2-core host,
    a 10-step build took 17 s on 2 threads and 5 s on 1. The weights do depend on the thread count (the order of
    float reductions; measured: 3-step builds on 1 and on 2 threads differ, each is byte-identical with itself), so
    a build is reproducible for one thread count, which its summary records ("threads").
    """
    cores = len(os.sched_getaffinity(0))
    busy = _busy_cores()
    return max(1, min(cores, (os.cpu_count() or cores) - round(busy)))


def _busy_cores(interval: float = 0.25) -> float:
    """How many cores other processes use, sampled from /proc/stat (we sleep meanwhile); load average elsewhere.

    The 1-minute load average lags by a minute, long enough to starve a build that starts just after
    another job ended, so it is only the fallback.
    """

    def snapshot() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(values), values[3] + values[4]  # all jiffies, idle + iowait jiffies

    try:
        total0, idle0 = snapshot()
        time.sleep(interval)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0
    if total1 <= total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


@contextmanager
def _cpu_threads(threads: int) -> Iterator[None]:
    """Run torch on ``threads`` threads, then restore the caller's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def make_readable(directory: Path) -> None:
    """chmod files 0644: some writers create weights 0600, which breaks serving them as another user."""
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
