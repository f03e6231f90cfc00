"""``BatchStore`` on PostgreSQL (psycopg 3): one server database that several gateway processes share, so any of
them answers a tenant's /v1/files and /v1/batches and all of them run its batches.

The statements are the SQLite store's (``sql.py``); what sharing adds:

- **Claims.** ``pending_lines`` with a ``limit`` (the runner taking lines to send) claims them for this process:
  ``SELECT ... FOR UPDATE SKIP LOCKED`` picks lines no other process holds, and each is marked with this store's
  ``owner`` and a lease (``now + claim_seconds``). No other gateway is given a claimed line until it is answered,
  deferred (a retry anyone may take), released (given back unanswered, or this store closed), or its lease ran
  out: a gateway that died holding lines hands them over after ``claim_seconds``. The lease outlasts one request
  (``gateway.request_timeout_seconds``, checked by the settings), so a line is never sent by two gateways at once.
  Leases are in the gateways' clock (``now``, as ``not_before`` is): their clocks must agree to well within it.
- **Writers side by side.** PostgreSQL runs transactions concurrently (READ COMMITTED), so a guarded transition
  locks its batch row (``FOR UPDATE``) before it decides, and ``record_results`` writes a line only while it is
  still pending: of two gateways recording the same line, the second finds it done and writes nothing.
- **Durability** is the server's: a commit returns once its WAL is flushed (``synchronous_commit`` on, the
  default).

The tables live in their own schema (``batch.database_schema``), created with them on first open under an
advisory lock, so gateways starting together create them once; ``schema_version`` refuses a newer schema as the
SQLite store does. The password comes from a file (``batch.database_password_file``) and is never logged: errors
name the server by ``redacted_url``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from appliance.batch.model import PendingLine
from appliance.batch.sql import Cursor, SQLBatchStore, newer_schema, pending, schema
from appliance.batch.store import StoreUnavailable
from appliance.setting_types import redacted_url

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MIGRATION_LOCK = 0x62617463685F7631  # pg_advisory_xact_lock's key for creating the schema ("batch_v1")
SCHEMA = schema(seq="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", big="BIGINT", real="DOUBLE PRECISION",
                claims="    owner TEXT,\n    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,\n") + (
    "CREATE INDEX lines_claimed ON lines (owner) WHERE owner IS NOT NULL AND done = 0;\n")
# The lines to send, claimed: pending, due, and held by no live claim of another process; locked rows (another
# gateway claiming them now) are skipped, not waited for.
CLAIM = """
WITH free AS (
    SELECT idx FROM lines
    WHERE batch_id = ? AND done = 0 AND not_before <= ? AND (owner IS NULL OR owner = ? OR lease_until <= ?)
      AND idx <> ALL(?::integer[])
    ORDER BY idx LIMIT ?
    FOR UPDATE SKIP LOCKED
)
UPDATE lines SET owner = ?, lease_until = ? FROM free WHERE lines.batch_id = ? AND lines.idx = free.idx
RETURNING lines.idx, lines.custom_id, lines.body, lines.attempts
"""


class PostgresBatchStore(SQLBatchStore):
    FOR_UPDATE = " FOR UPDATE"

    def __init__(self, url: str, *, password: str | None = None, schema: str = "appliance_batch",
                 claim_seconds: float = 900.0, connect_timeout_seconds: float = 10.0, owner: str | None = None
                 ) -> None:
        """``owner``: this process's name on its claims (unique per store; the host and pid help an operator)."""
        self.where = redacted_url(url)
        self.schema = schema
        self.claim_seconds = claim_seconds
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._url = url
        self._password = password
        self._connect_timeout = connect_timeout_seconds
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._migrate()

    def _connect(self) -> psycopg.Connection[Any]:
        extra: dict[str, Any] = {"password": self._password} if self._password is not None else {}
        try:
            return psycopg.connect(self._url, autocommit=True, application_name="appliance-batch",
                                   connect_timeout=max(1, round(self._connect_timeout)),
                                   options=f"-c search_path={self.schema}", **extra)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"{self.where}: {_first_line(exc)}") from None

    def _migrate(self) -> None:
        with self._tx() as db:
            db.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
            if db.execute("SELECT 1 FROM pg_namespace WHERE nspname = ?", (self.schema,)).fetchone() is None:
                db.execute(f"CREATE SCHEMA {self.schema}")  # a name settings allow only as an identifier
            if db.execute("SELECT to_regclass(?)", (f"{self.schema}.schema_version",)).fetchone()[0] is None:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                log.info("batch store: created schema %s in %s", self.schema, self.where)
                return
            version = db.execute("SELECT max(version) FROM schema_version").fetchone()[0]
            if version is None or version > SCHEMA_VERSION:
                raise newer_schema(f"{self.where} schema {self.schema}", version, SCHEMA_VERSION)

    @contextmanager
    def _tx(self) -> Iterator[_Tx]:
        """One transaction; a connection lost before is made again (a server restart costs the calls made while
        it was down: they raise ``StoreUnavailable``, and the runner tries again at its next step)."""
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            try:
                with self._conn.transaction():
                    yield _Tx(self._conn)
            except psycopg.OperationalError as exc:
                if not self._conn.closed:
                    raise
                raise StoreUnavailable(f"{self.where}: {_first_line(exc)}") from None

    def close(self) -> None:
        """Release this process's claims (another gateway takes them at once instead of after the lease), and
        close the connection."""
        try:
            with self._tx() as db:
                db.execute("UPDATE lines SET owner = NULL WHERE owner = ? AND done = 0", (self.owner,))
        except (psycopg.Error, StoreUnavailable) as exc:
            log.warning("batch store: claims not released (%s); they pass to other gateways after %.0f s",
                        _first_line(exc), self.claim_seconds)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def pending_lines(self, batch_id: str, *, now: float, exclude: Collection[int], limit: int | None
                      ) -> list[PendingLine]:
        """With ``limit``: claimed for this process (module docstring). Without: every pending line, only read (an
        ended batch closing its lines, whoever holds them)."""
        if limit is None:
            return super().pending_lines(batch_id, now=now, exclude=exclude, limit=None)
        with self._tx() as db:
            return pending(batch_id, db.execute(CLAIM, (batch_id, now, self.owner, now, list(exclude), limit,
                                                        self.owner, now + self.claim_seconds, batch_id)).fetchall())

    def defer_line(self, batch_id: str, index: int, *, attempts: int, not_before: float) -> None:
        """Released as well: the retry goes to whichever gateway has room first."""
        with self._tx() as db:
            db.execute("UPDATE lines SET attempts = ?, not_before = ?, owner = NULL WHERE batch_id = ? AND idx = ? "
                       "AND done = 0", (attempts, not_before, batch_id, index))

    def release(self, batch_id: str, indexes: Sequence[int]) -> None:
        with self._tx() as db:
            db.execute("UPDATE lines SET owner = NULL WHERE batch_id = ? AND idx = ANY(?::integer[]) AND owner = ? "
                       "AND done = 0", (batch_id, list(indexes), self.owner))


class _Tx:
    """The connection inside one transaction; the shared statements' ``?`` become psycopg's ``%s`` (no shared
    statement holds a ``?`` or a ``%`` of its own)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        return self._conn.execute(sql.replace("?", "%s"), args)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s"), rows)



def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
