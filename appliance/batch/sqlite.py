"""``BatchStore`` on SQLite (the standard library's ``sqlite3``): one database file under the state folder.

WAL journal with ``synchronous=FULL``: every commit is on disk when the call returns (a line's result survives the
process being killed, and the host losing power), and readers never wait for the writer. Each method is one
transaction (``BEGIN IMMEDIATE``: the write lock is taken up front, so two writers never both fail to upgrade).
The schema has a version (``schema_version``); an older database is migrated on open, a newer one refused.

One connection, used under a lock, so the store may be called from any thread; the Batch API calls it from one
thread of its own (``service.Storage``) so that no fsync ever blocks the gateway's event loop.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX files_by_tenant ON files (tenant, seq);
CREATE TABLE batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    model TEXT,
    metadata TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
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
    not_before REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX lines_to_do ON lines (batch_id, done, idx);
"""
BATCH_COLUMNS = ("id, tenant, endpoint, input_file_id, completion_window, status, created_at, expires_at, model, "
                 "metadata, total, completed, failed, input_tokens, output_tokens, cached_tokens, outcome, errors, "
                 "output_file_id, error_file_id, times")
FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at"


class SchemaError(RuntimeError):
    """The database was written by a newer appliance (a schema this one does not know)."""


class SQLiteBatchStore:
    """The Batch API's storage in one SQLite file (created with its folder when missing)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        with self._tx() as db:
            known = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "schema_version" not in known:
                db.executescript_in_tx(SCHEMA)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                return
            version = db.execute("SELECT max(version) FROM schema_version").fetchone()[0]
            if version is None or version > SCHEMA_VERSION:
                raise SchemaError(f"{self.path}: batch database schema {version} is newer than this appliance's "
                                  f"({SCHEMA_VERSION}); use the appliance that wrote it, or another database")

    @contextmanager
    def _tx(self) -> Iterator[_Tx]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _Tx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
                             f"{'-1' if newest_first else '1 << 62'})")
                args.append(after)
            rows = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE {' AND '.join(where)} ORDER BY seq {order} "
                              "LIMIT ?", (*args, limit)).fetchall()
        return [_file(row) for row in rows]

    def delete_file(self, file_id: str, tenant: str) -> FileRecord | None:
        with self._tx() as db:
            row = db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ?",
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
            record = _get_batch(db, batch_id)
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
            current = _get_batch(db, batch_id)
            if current is None or current.status not in sources:
                return None
            times = {**current.times, to.value: at}
            db.execute("UPDATE batches SET status = ?, times = ?, outcome = coalesce(?, outcome) WHERE id = ?",
                       (to.value, json.dumps(times), outcome.value if outcome else None, batch_id))
            return _get_batch(db, batch_id)

    def finish(self, batch_id: str, to: Status, at: int, *, output: FileRecord | None, error: FileRecord | None,
               errors: list[dict[str, object]] | None = None) -> BatchRecord | None:
        with self._tx() as db:
            current = _get_batch(db, batch_id)
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
            return _get_batch(db, batch_id)

    def fail(self, batch_id: str, at: int, errors: list[dict[str, object]]) -> BatchRecord | None:
        with self._tx() as db:
            current = _get_batch(db, batch_id)
            if current is None or current.status not in (Status.VALIDATING, Status.IN_PROGRESS):
                return None
            times = {**current.times, Status.FAILED.value: at}
            db.execute("UPDATE batches SET status = ?, times = ?, errors = ? WHERE id = ?",
                       (Status.FAILED.value, json.dumps(times), json.dumps(errors), batch_id))
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            return _get_batch(db, batch_id)

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
            rows = db.execute(query, args).fetchall()
        return [PendingLine(batch_id, idx, custom_id, body, attempts) for idx, custom_id, body, attempts in rows]

    def record_results(self, batch_id: str, results: Sequence[tuple[int, LineResult]]) -> list[int]:
        recorded: list[int] = []
        usage = Usage()
        completed = failed = 0
        with self._tx() as db:
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


class _Tx:
    """The connection inside one transaction (``executescript`` would commit it: statements go one by one)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> sqlite3.Cursor:
        return self._db.executemany(sql, rows)

    def executescript_in_tx(self, script: str) -> None:
        for statement in script.split(";"):
            if statement.strip():
                self._db.execute(statement)


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _insert_file(db: _Tx, record: FileRecord) -> None:
    db.execute(f"INSERT INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
               (record.id, record.tenant, record.purpose, record.filename, record.bytes, record.created_at))


def _file(row: Sequence[Any]) -> FileRecord:
    return FileRecord(*row)


def _get_batch(db: _Tx, batch_id: str) -> BatchRecord | None:
    row = db.execute(f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return _batch(row) if row else None


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
