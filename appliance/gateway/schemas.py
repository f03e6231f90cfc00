"""Request schemas: only the fields the gateway must check; everything else passes through to vLLM untouched.

The models document the API (OpenAPI) and reject what would make vLLM fail late: wrong types, empty messages,
non-positive ``max_tokens``. The body forwarded upstream is the client's own bytes, not a re-serialisation.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

PromptTokens = list[StrictInt]
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")  # vLLM 0.32's validate_cache_salt (generate/base/protocol.py)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = Field(None, description="Served model name; see GET /v1/models.")
    stream: StrictBool = False
    max_tokens: StrictInt | None = Field(None, ge=1, description="At most the model's max_model_len.")
    n: StrictInt | None = Field(None, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    cache_salt: StrictStr | None = Field(
        None, min_length=1, max_length=128, description="Partitions the prefix cache within the caller's own "
        "tenant (the gateway folds it into the tenant's salt: it never reaches another tenant's cache)."
    )

    @field_validator("cache_salt")
    @classmethod
    def _salt_as_vllm_takes_it(cls, value: str | None) -> str | None:
        """vLLM's own rule, so that a salt the gateway folds away is refused as vLLM would refuse it."""
        if value is not None and any(char in CACHE_SALT_FORBIDDEN for char in value):
            raise ValueError("must not contain '@', '/', '\\' or NUL")
        return value


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | PromptTokens | list[PromptTokens] = Field(
        ..., description="Text, texts, token ids or lists of token ids.", min_length=1
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(..., min_length=1)
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "appliance"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
