"""What the Batch API stores: files, batches and each request line, as plain values.

The storage (``store.py``) keeps these and nothing else; the API (``service.py``) and the runner (``runner.py``)
read and write them only through it, so a server database can take SQLite's place without either changing."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """OpenAI's batch life cycle. ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; or
    ``cancelling`` -> ``cancelled`` (a cancel), ``finalizing`` -> ``expired`` (its window passed), ``failed`` (its
    results could not be written)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED})
RUNNING = frozenset({Status.VALIDATING, Status.IN_PROGRESS})  # lines may still be sent
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # endpoint -> the proxy's route
PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
OUTPUT, ERROR = "output", "error"  # the file a line's result goes to


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _derived(*parts: object) -> str:
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()[:24]


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: derived from the batch, so that writing it again after a crash
    replaces the same file instead of leaving a second one."""
    return "file-" + _derived(batch_id, kind)


def line_request_id(batch_id: str, index: int) -> str:
    """The id of one line's request (its x-request-id, its request record, ``id`` in the result line): the same
    every time the line is sent."""
    return "batch_req_" + _derived(batch_id, index)


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def to_json(self, retention_seconds: int = 0) -> dict[str, Any]:
        """OpenAI's file object; ``expires_at`` when files are deleted after ``retention_seconds`` (0: never)."""
        expires = self.created_at + retention_seconds if retention_seconds > 0 else None
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": expires,
                "status_details": None}


@dataclass(frozen=True)
class Usage:
    """Tokens the engines reported for a batch's answered lines."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens,
                     self.cached_tokens + other.cached_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    expires_at: int
    model: str | None = None
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0  # lines answered 2xx (the output file)
    failed: int = 0  # lines in the error file: malformed, answered 4xx/5xx, expired, cancelled
    usage: Usage = field(default_factory=Usage)
    outcome: Status | None = None  # what a finalizing or cancelling batch ends as
    errors: list[dict[str, Any]] | None = None  # why a batch failed
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int] = field(default_factory=dict)  # status -> when it began (in_progress, finalizing ...)

    @property
    def pending(self) -> int:
        return self.total - self.completed - self.failed

    def to_json(self, *, tenant: bool = False) -> dict[str, Any]:
        """OpenAI's Batch object; ``tenant``: with whose it is (the operator's view)."""
        body: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.value, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
        }
        for status in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"):
            body[f"{status}_at"] = self.times.get(status)
        body["request_counts"] = {"total": self.total, "completed": self.completed, "failed": self.failed}
        body["usage"] = self.usage.to_json()
        body["metadata"] = self.metadata
        if tenant:
            body["tenant"] = self.tenant
        return body


@dataclass(frozen=True)
class LineResult:
    """One line's answer, as it goes into its file: ``text`` is the whole JSONL line (no newline)."""

    kind: str  # OUTPUT or ERROR
    text: str
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class LineInput:
    """One line of an input file as a batch stores it: the request to send, or (malformed) its result already."""

    index: int  # the line's number in the input file: the order of the result files
    custom_id: str | None
    body: str | None  # the request body, compact JSON; None for a malformed line
    result: LineResult | None = None  # set for a malformed line: it fails at once


@dataclass(frozen=True)
class PendingLine:
    """A line still to answer."""

    batch_id: str
    index: int
    custom_id: str
    body: str
    attempts: int = 0  # server errors it had so far


@dataclass(frozen=True)
class Summary:
    """What the metrics read: batches by tenant and status, and the line counts of the batches not yet ended."""

    batches: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, status) -> batches
    active: list[BatchRecord] = field(default_factory=list)
