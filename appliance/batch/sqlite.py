"""``BatchStore`` on SQLite (the standard library's ``sqlite3``): one database file under the state folder.

WAL journal with ``synchronous=FULL``: every commit is on disk when the call returns (a line's result survives the
process being killed, and the host losing power), and readers never wait for the writer. Each method is one
transaction (``BEGIN IMMEDIATE``: the write lock is taken up front, so two writers never both fail to upgrade).
The schema has a version (``schema_version``); an older database is migrated on open, a newer one refused.

One connection, used under a lock, so the store may be called from any thread; the Batch API calls it from one
thread of its own (``service.Storage``) so that no fsync ever blocks the gateway's event loop.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.batch.sql import SchemaError, SQLBatchStore, newer_schema, schema

__all__ = ["SCHEMA_VERSION", "SQLiteBatchStore", "SchemaError"]

SCHEMA_VERSION = 1
SCHEMA = schema(seq="INTEGER PRIMARY KEY AUTOINCREMENT", big="INTEGER", real="REAL", lines_table=" WITHOUT ROWID")


class SQLiteBatchStore(SQLBatchStore):
    """The Batch API's storage in one SQLite file (created with its folder when missing); its statements are the
    shared ones (``sql.py``)."""

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
                raise newer_schema(str(self.path), version, SCHEMA_VERSION)

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


class _Tx:
    """The connection inside one transaction (``executescript`` would commit it: statements go one by one)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)

    def executescript_in_tx(self, script: str) -> None:
        for statement in script.split(";"):
            if statement.strip():
                self._db.execute(statement)
