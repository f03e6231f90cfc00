"""The ``batch`` section: OpenAI's Batch API on idle capacity (``appliance.batch``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.secret_files import read_secret_file
from appliance.setting_types import blank_is_unset

UPLOAD_FRAMING_BYTES = 1 << 20  # an upload's body: the file, plus the multipart form's framing and other fields


class BatchSettings(BaseModel):
    """Offline work (evaluation sets, nightly summaries) sent as OpenAI batches, run only on the capacity
    interactive traffic leaves: where its state lives, what an upload may hold, and how batch lines yield."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Serve /v1/files and /v1/batches and run batches on idle capacity. Off: those routes "
        "answer 404 and nothing is run (batches already stored wait until it is on again)."
    )
    database: Path | None = Field(
        None, description="The SQLite database of files, batches and each line's result. Unset: "
        "state_dir/batch/batch.sqlite3. Created on the first upload; an appliance that never saw a batch writes "
        "nothing."
    )
    database_url: str | None = Field(
        None, description="A PostgreSQL database (postgresql://user@host:port/dbname, libpq's parameters such as "
        "?sslmode=verify-full after it) shared by several gateways: set, it takes the place of database, and every "
        "gateway pointing at it serves and runs the same batches (files_dir must then be one folder they all "
        "mount). PostgreSQL 13 or newer. No password here: set database_password_file."
    )
    database_password_file: Path | None = Field(
        None, description="File holding the PostgreSQL password (a mounted secret). The store keeps the password "
        "read at start: a new one takes a restart."
    )
    database_schema: str = Field(
        "appliance_batch", pattern=r"^[a-z_][a-z0-9_]{0,62}$", description="The PostgreSQL schema of the tables, "
        "created with them on first use when missing, so appliances sharing one database keep apart; gateways "
        "sharing batches use the same one."
    )
    database_connect_timeout_seconds: float = Field(
        10.0, gt=0, le=300, description="Longest connecting to the PostgreSQL database may take; past it the call "
        "fails (the API answers 503 batch_store_unavailable, the runner tries again at its next step)."
    )
    claim_seconds: float = Field(
        900.0, gt=0, description="PostgreSQL only: a line a gateway took to send is held from the others this long "
        "(renewed each time it is sent, released when it goes back unanswered), so a gateway that dies with lines in "
        "flight hands them over after it. "
        "Must exceed gateway.request_timeout_seconds: a line in flight is never sent by a second gateway."
    )
    files_dir: Path | None = Field(
        None, description="Where uploaded and result files are kept (one file each, written atomically). Unset: "
        "state_dir/batch/files. With database_url, one folder every gateway mounts (NFS, a ReadWriteMany volume)."
    )
    max_file_bytes: int = Field(
        16_777_216, ge=1024, description="Largest file /v1/files accepts (400 file_too_large beyond it); the "
        "upload's body may exceed it by 1 MiB of multipart framing, and never intake.body_budget_bytes (413)."
    )
    max_lines: int = Field(50_000, ge=1, description="Most request lines one batch may hold (400 beyond it).")
    max_completion_window_hours: int = Field(
        24, ge=1, description="Longest completion_window a batch may ask for, as \"<N>h\" (OpenAI's is \"24h\"). "
        "Past its window a batch expires with what is done: outputs for the lines answered, batch_expired errors "
        "for the rest."
    )
    file_retention_hours: int = Field(
        720, ge=0, description="How long a file (an upload, a batch's output or error file) is kept after it was "
        "created: then it is deleted, its record and its bytes, as if its tenant had deleted it, except the input "
        "file of a batch still running. Files report it as expires_at. 0: kept until deleted."
    )
    max_concurrency: int = Field(
        4, ge=1, description="Batch lines in flight at once, all batches together: the most slots batch work "
        "holds when the fleet is idle."
    )
    headroom_fraction: float = Field(
        0.25, ge=0, lt=1, description="Share of each replica's adaptive limit (admission) kept free for "
        "interactive requests: a batch line is sent to a replica only while its requests in flight are below "
        "limit x (1 - headroom_fraction), and only while no request waits in the admission queue."
    )
    preempt: bool = Field(
        True, description="When an interactive request has to wait in the admission queue, give back every batch "
        "line in flight at once (the engine aborts it; the line runs again later). Off: lines in flight finish, "
        "only new ones wait."
    )
    yield_seconds: float = Field(
        0.1, ge=0, description="After an interactive request arrives, no new batch line is sent for this long "
        "(lines in flight go on): its prefill and first token do not share the engine's steps, nor the host's "
        "cores, with batch lines starting. Each arrival holds from its own time. 0: off."
    )
    max_yield_seconds: float = Field(
        0.5, gt=0, description="Longest batch.yield_seconds holds back new lines in a row while interactive "
        "requests keep arriving; then lines are sent for batch.yield_seconds before an arrival holds them again, "
        "so a steady interactive stream slows a batch and never stops it."
    )
    backoff_seconds: float = Field(
        2.0, gt=0, description="After a preemption, or when no capacity was idle, how long batch work waits before "
        "it tries again; a failed line (5xx) waits this long times 2^attempt."
    )
    max_attempts: int = Field(
        3, ge=1, description="Tries per line on a server error (500, 502, 504) before its error goes to the error "
        "file. 429 and 503 (no room now, draining) are not tries: the line waits and runs later."
    )
    poll_seconds: float = Field(
        0.5, gt=0, description="How often the batch runner looks for work, expiries and cancellations when nothing "
        "woke it (an upload, a finished line, a cancel wake it at once)."
    )

    _password: str | None = None

    @field_validator("database_url", "database_password_file", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @model_validator(mode="after")
    def _read_password(self) -> BatchSettings:
        if self.database_url is not None:
            parts = urlsplit(self.database_url)
            if parts.scheme not in ("postgresql", "postgres"):
                raise ValueError("batch.database_url: a postgresql:// URL")
            if parts.password or "password=" in parts.query:
                raise ValueError("batch.database_url holds a password: set batch.database_password_file instead")
        self._password = (read_secret_file(self.database_password_file, setting="batch.database_password_file")
                          if self.database_password_file is not None else None)
        return self

    @property
    def database_password(self) -> str | None:
        return self._password
