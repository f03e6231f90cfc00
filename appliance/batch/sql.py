"""The ``BatchStore`` methods both SQL databases share (``sqlite.py``, ``postgres.py``): the same statements, so the
two stores keep one meaning.

The statements are written in the SQL both speak, with ``?`` placeholders (the PostgreSQL store's transaction turns
them into psycopg's ``%s``). A store subclass gives the transaction (``_tx``: one per method, so each method is one
transaction) and ``FOR_UPDATE``: PostgreSQL runs writers side by side, so a method that reads a row to decide what
to write (a guarded transition) locks it first; SQLite's writers take the database's one write lock up front
(``BEGIN IMMEDIATE``), so its reads need no lock.

Lock order, for a server database where several gateways write at once: a method that writes a batch and its lines
locks the batch row first, then the lines (``record_results`` included), so two such methods never wait for each
other in a circle.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from string import Template
from typing import Any, Protocol

from appliance.batch.model import (
    OUTPUT,
    TERMINAL,
    BatchRecord,
    FileRecord,
    LineInput,
    LineResult,
    PendingLine,
    Status,
    Summary,
    Usage,
)

# The tables in the words both databases know; ``schema`` fills in the few where they differ.
SCHEMA = Template("""
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE files (
    seq $seq,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes $big NOT NULL,
    created_at $big NOT NULL
);
CREATE INDEX files_by_tenant ON files (tenant, seq);
CREATE TABLE batches (
    seq $seq,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at $big NOT NULL,
    expires_at $big NOT NULL,
    model TEXT,
    metadata TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens $big NOT NULL DEFAULT 0,
    output_tokens $big NOT NULL DEFAULT 0,
    cached_tokens $big NOT NULL DEFAULT 0,
    outcome TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    times TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX batches_by_tenant ON batches (tenant, seq);
CREATE INDEX batches_by_status ON batches (status);
CREATE TABLE lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT,
    body TEXT,
    done INTEGER NOT NULL DEFAULT 0,
    kind TEXT,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before $real NOT NULL DEFAULT 0,
$claims    PRIMARY KEY (batch_id, idx)
)$lines_table;
CREATE INDEX lines_to_do ON lines (batch_id, done, idx);
""")
BATCH_COLUMNS = ("id, tenant, endpoint, input_file_id, completion_window, status, created_at, expires_at, model, "
                 "metadata, total, completed, failed, input_tokens, output_tokens, cached_tokens, outcome, errors, "
                 "output_file_id, error_file_id, times")
FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at"
NO_SEQ = "9223372036854775807"  # above every row's seq: a cursor naming an unknown id pages past the end


def schema(*, seq: str, big: str, real: str, claims: str = "", lines_table: str = "") -> str:
    """The tables' DDL for one database: ``seq`` its auto-numbered key, ``big`` a 64-bit integer, ``real`` a double;
    ``claims``: more columns of the lines (PostgreSQL's claims), ``lines_table``: options of the lines table."""
    return SCHEMA.substitute(seq=seq, big=big, real=real, claims=claims, lines_table=lines_table)


class SchemaError(RuntimeError):
    """The database was written by a newer appliance (a schema this one does not know)."""


def newer_schema(where: str, version: object, known: int) -> SchemaError:
    return SchemaError(f"{where}: batch database schema {version} is newer than this appliance's ({known}); use the "
                       "appliance that wrote it, or another database")


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Tx(Protocol):
    """One transaction's statements (``?`` placeholders)."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...


class SQLBatchStore:
    """``BatchStore`` over any ``Tx``; subclasses give ``_tx`` and ``close``."""

    FOR_UPDATE = ""

    def _tx(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- files ----------------------------------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None:
        with self._tx() as db:
            _insert_file(db, record)

    def get_file(self, file_id: str, tenant: str | None) -> FileRecord | None:
        with self._tx() as db:
            row = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        record = _file(row) if row else None
        return record if record is not None and tenant in (None, record.tenant) else None

    def list_files(self, tenant: str, *, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> list[FileRecord]:
        order, cmp = ("DESC", "<") if newest_first else ("ASC", ">")
        where, args = ["tenant = ?"], [tenant]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        with self._tx() as db:
            if after is not None:
                where.append(f"seq {cmp} coalesce((SELECT seq FROM files WHERE id = ?), "
                             f"{'-1' if newest_first else NO_SEQ})")
                args.append(after)
            rows = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE {' AND '.join(where)} ORDER BY seq {order} "
                              "LIMIT ?", (*args, limit)).fetchall()
        return [_file(row) for row in rows]

    def delete_file(self, file_id: str, tenant: str) -> FileRecord | None:
        with self._tx() as db:
            row = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ?{self.FOR_UPDATE}",
                             (file_id, tenant)).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return _file(row)

    def expired_files(self, created_by: int, limit: int) -> list[FileRecord]:
        ended = ", ".join("?" * len(TERMINAL))
        with self._tx() as db:
            rows = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE created_at <= ? AND id NOT IN "
                              f"(SELECT input_file_id FROM batches WHERE status NOT IN ({ended})) "
                              "ORDER BY seq LIMIT ?",
                              (created_by, *sorted(status.value for status in TERMINAL), limit)).fetchall()
        return [_file(row) for row in rows]

    def forget_files(self, file_ids: Collection[str]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM files WHERE id = ?", [(file_id,) for file_id in file_ids])

    def file_ids(self) -> set[str]:
        with self._tx() as db:
            return {row[0] for row in db.execute("SELECT id FROM files")}

    # -- batches --------------------------------------------------------------------------------------------------

    def create_batch(self, batch: BatchRecord, lines: Sequence[LineInput]) -> None:
        failed = [line for line in lines if line.result is not None]
        with self._tx() as db:
            db.execute(f"INSERT INTO batches ({BATCH_COLUMNS}) VALUES ({', '.join('?' * 21)})",
                       (batch.id, batch.tenant, batch.endpoint, batch.input_file_id, batch.completion_window,
                        batch.status.value, batch.created_at, batch.expires_at, batch.model,
                        _dump(batch.metadata), len(lines), 0, len(failed), 0, 0, 0, None, None, None, None,
                        json.dumps(batch.times)))
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, done, kind, result) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(batch.id, line.index, line.custom_id, line.body, int(line.result is not None),
                             line.result.kind if line.result else None, line.result.text if line.result else None)
                            for line in lines])

    def get_batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        with self._tx() as db:
            record = self._get_batch(db, batch_id)
        return record if record is not None and tenant in (None, record.tenant) else None

    def list_batches(self, tenant: str | None, *, status: Status | None, after: str | None,
                     limit: int) -> list[BatchRecord]:
        where: list[str] = []
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if status is not None:
            where.append("status = ?")
            args.append(status.value)
        with self._tx() as db:
            if after is not None:
                where.append("seq < coalesce((SELECT seq FROM batches WHERE id = ?), -1)")
                args.append(after)
            clause = f"WHERE {' AND '.join(where)}" if where else ""
            rows = db.execute(f"SELECT {BATCH_COLUMNS} FROM batches {clause} ORDER BY seq DESC LIMIT ?",
                              (*args, limit)).fetchall()
        return [_batch(row) for row in rows]

    def active_batches(self) -> list[BatchRecord]:
        ended = tuple(status.value for status in TERMINAL)
        with self._tx() as db:
            rows = db.execute(f"SELECT {BATCH_COLUMNS} FROM batches WHERE status NOT IN "
                              f"({', '.join('?' * len(ended))}) ORDER BY seq", ended).fetchall()
        return [_batch(row) for row in rows]

    def transition(self, batch_id: str, to: Status, at: int, *, sources: Collection[Status],
                   outcome: Status | None = None) -> BatchRecord | None:
        with self._tx() as db:
            current = self._get_batch(db, batch_id, lock=True)
            if current is None or current.status not in sources:
                return None
            times = {**current.times, to.value: at}
            db.execute("UPDATE batches SET status = ?, times = ?, outcome = coalesce(?, outcome) WHERE id = ?",
                       (to.value, json.dumps(times), outcome.value if outcome else None, batch_id))
            return self._get_batch(db, batch_id)

    def finish(self, batch_id: str, to: Status, at: int, *, output: FileRecord | None, error: FileRecord | None,
               errors: list[dict[str, object]] | None = None) -> BatchRecord | None:
        with self._tx() as db:
            current = self._get_batch(db, batch_id, lock=True)
            if current is None or current.status not in (Status.FINALIZING, Status.CANCELLING):
                return None
            for record in (output, error):
                if record is not None:
                    db.execute("DELETE FROM files WHERE id = ?", (record.id,))  # recorded by a try that crashed
                    _insert_file(db, record)
            times = {**current.times, to.value: at}
            db.execute("UPDATE batches SET status = ?, times = ?, output_file_id = ?, error_file_id = ?, errors = ? "
                       "WHERE id = ?", (to.value, json.dumps(times), output.id if output else None,
                                        error.id if error else None, _dump(errors), batch_id))
            # The results are in the files now: the lines' rows would only grow the database.
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            return self._get_batch(db, batch_id)

    def fail(self, batch_id: str, at: int, errors: list[dict[str, object]]) -> BatchRecord | None:
        with self._tx() as db:
            current = self._get_batch(db, batch_id, lock=True)
            if current is None or current.status not in (Status.VALIDATING, Status.IN_PROGRESS):
                return None
            times = {**current.times, Status.FAILED.value: at}
            db.execute("UPDATE batches SET status = ?, times = ?, errors = ? WHERE id = ?",
                       (Status.FAILED.value, json.dumps(times), json.dumps(errors), batch_id))
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            return self._get_batch(db, batch_id)

    # -- lines ----------------------------------------------------------------------------------------------------

    def pending_lines(self, batch_id: str, *, now: float, exclude: Collection[int], limit: int | None
                      ) -> list[PendingLine]:
        skip = tuple(exclude)
        query = "SELECT idx, custom_id, body, attempts FROM lines WHERE batch_id = ? AND done = 0 AND not_before <= ?"
        if skip:
            query += f" AND idx NOT IN ({', '.join('?' * len(skip))})"
        query += " ORDER BY idx" + (" LIMIT ?" if limit is not None else "")
        args = (batch_id, now, *skip, *(() if limit is None else (limit,)))
        with self._tx() as db:
            return pending(batch_id, db.execute(query, args).fetchall())

    def release(self, batch_id: str, indexes: Sequence[int]) -> None:
        """Nothing is claimed in a store of one process (PostgreSQL's claims: ``postgres.py``)."""

    def record_results(self, batch_id: str, results: Sequence[tuple[int, LineResult]]) -> list[int]:
        recorded: list[int] = []
        usage = Usage()
        completed = failed = 0
        with self._tx() as db:
            db.execute(f"SELECT id FROM batches WHERE id = ?{self.FOR_UPDATE}", (batch_id,))  # the batch first
            for index, result in results:
                cursor = db.execute("UPDATE lines SET done = 1, kind = ?, result = ?, body = NULL "
                                    "WHERE batch_id = ? AND idx = ? AND done = 0",
                                    (result.kind, result.text, batch_id, index))
                if cursor.rowcount != 1:
                    continue
                recorded.append(index)
                usage = usage + result.usage
                if result.kind == OUTPUT:
                    completed += 1
                else:
                    failed += 1
            if recorded:
                db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                           "input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, "
                           "cached_tokens = cached_tokens + ? WHERE id = ?",
                           (completed, failed, usage.input_tokens, usage.output_tokens, usage.cached_tokens,
                            batch_id))
        return recorded

    def defer_line(self, batch_id: str, index: int, *, attempts: int, not_before: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE lines SET attempts = ?, not_before = ? WHERE batch_id = ? AND idx = ? AND done = 0",
                       (attempts, not_before, batch_id, index))

    def results(self, batch_id: str, kind: str) -> list[str]:
        with self._tx() as db:
            return [row[0] for row in db.execute("SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND "
                                                 "kind = ? ORDER BY idx", (batch_id, kind))]

    def summary(self) -> Summary:
        with self._tx() as db:
            counts = {(tenant, status): count for tenant, status, count in
                      db.execute("SELECT tenant, status, count(*) FROM batches GROUP BY tenant, status")}
        return Summary(counts, self.active_batches())

    def _get_batch(self, db: Tx, batch_id: str, *, lock: bool = False) -> BatchRecord | None:
        """``lock``: the row is held until the transaction ends (a guarded transition decides from it)."""
        row = db.execute(f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?{self.FOR_UPDATE if lock else ''}",
                         (batch_id,)).fetchone()
        return _batch(row) if row else None


def pending(batch_id: str, rows: Sequence[Sequence[Any]]) -> list[PendingLine]:
    """Rows of (idx, custom_id, body, attempts), in input order."""
    return [PendingLine(batch_id, idx, custom_id, body, attempts) for idx, custom_id, body, attempts in
            sorted(rows, key=lambda row: row[0])]


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _insert_file(db: Tx, record: FileRecord) -> None:
    db.execute(f"INSERT INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
               (record.id, record.tenant, record.purpose, record.filename, record.bytes, record.created_at))


def _file(row: Sequence[Any]) -> FileRecord:
    return FileRecord(*row)


def _batch(row: Sequence[Any]) -> BatchRecord:
    (id_, tenant, endpoint, input_file_id, window, status, created_at, expires_at, model, metadata, total,
     completed, failed, input_tokens, output_tokens, cached_tokens, outcome, errors, output_file_id,
     error_file_id, times) = row
    return BatchRecord(id=id_, tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
                       completion_window=window, status=Status(status), created_at=created_at, expires_at=expires_at,
                       model=model, metadata=json.loads(metadata) if metadata else None, total=total,
                       completed=completed, failed=failed, usage=Usage(input_tokens, output_tokens, cached_tokens),
                       outcome=Status(outcome) if outcome else None, errors=json.loads(errors) if errors else None,
                       output_file_id=output_file_id, error_file_id=error_file_id, times=json.loads(times))
