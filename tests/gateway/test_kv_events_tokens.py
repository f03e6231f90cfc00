"""Which requests the gateway tokenizes for precise routing, and that it tokenizes them as vLLM does (the demo
model's own tokenizer and chat template; tests/integration/test_kv_events.py checks it against a real engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from appliance.gateway.routing.kv_events.hashing import BlockHasher
from appliance.gateway.routing.kv_events.tokens import PromptTokenizer, PromptTokens, token_job


def test_completion_prompts_it_can_tokenize():
    assert token_job("completions", {"prompt": "hello"}).text == "hello"
    assert token_job("completions", {"prompt": ["hello"]}).text == "hello"
    assert token_job("completions", {"prompt": [1, 2, 3]}).ids == [1, 2, 3]
    assert token_job("completions", {"prompt": [[1, 2, 3]]}).ids == [1, 2, 3]
    assert not token_job("completions", {"prompt": "x", "add_special_tokens": False}).add_special_tokens
    assert token_job("completions", {"prompt": "x", "cache_salt": "s1"}).salt == "s1"


@pytest.mark.parametrize("body", [
    {"prompt": ["one", "two"]},  # several prompts: several requests at the engine
    {"prompt": [[1], [2]]},
    {"prompt": [1, True]},
    {"prompt": "x", "prompt_embeds": "..."},
    {"prompt": "x", "add_special_tokens": "yes"},
    {"prompt": None},
])
def test_completion_prompts_left_to_the_approximate_scorer(body):
    assert token_job("completions", body) is None


def test_chat_messages_and_the_options_vllm_renders_them_with():
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          "name": "ann", "extra": 1}],
            "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}, "cache_salt": "t"}
    job = token_job("chat", body)
    assert job.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "a\nb", "name": "ann"}]
    assert job.chat == {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}
    assert token_job("chat", {"messages": [{"role": "user", "content": "x"}]}).chat == {"add_generation_prompt": True}
    assert job.salt == "t"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}],
    [{"content": "no role"}],
    [],
    "not a list",
])
def test_chat_requests_left_to_the_approximate_scorer(messages):
    assert token_job("chat", {"messages": messages}) is None
    assert token_job("embeddings", {"input": "x"}) is None


@pytest.fixture(scope="module")
def tokenizer(demo_model_int8: Path):
    tokenizer = PromptTokenizer(demo_model_int8, threads=1)
    yield tokenizer
    tokenizer.close()


def test_text_is_encoded_with_the_models_special_tokens(tokenizer: PromptTokenizer, demo_model_int8: Path):
    reference = AutoTokenizer.from_pretrained(str(demo_model_int8), local_files_only=True)
    job = token_job("completions", {"prompt": "The for statement iterates."})
    ids = tokenizer.tokenize(job)
    assert ids == reference.encode("The for statement iterates.")
    assert ids[0] == reference.bos_token_id
    bare = tokenizer.tokenize(token_job("completions", {"prompt": "x", "add_special_tokens": False}))
    assert bare[0] != reference.bos_token_id


def test_chat_is_rendered_by_the_models_template(tokenizer: PromptTokenizer, demo_model_int8: Path):
    reference = AutoTokenizer.from_pretrained(str(demo_model_int8), local_files_only=True)
    messages = [{"role": "user", "content": "What does a for loop do?"}]
    ids = tokenizer.tokenize(token_job("chat", {"messages": messages}))
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("Assistant:")
    assert ids == reference.encode(text, add_special_tokens=False)  # the template's BOS, once
    assert ids.count(reference.bos_token_id) == 1


def test_a_prompts_keys_are_computed_once_per_block_size():
    prompt = PromptTokens(list(range(40)), salt="s")
    hasher = BlockHasher("random")
    first = prompt.keys(hasher, 16)
    assert prompt.keys(hasher, 16) is first and len(first) == 2
    assert len(prompt.keys(hasher, 8)) == 5


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        PromptTokenizer(tmp_path, threads=1)
