"""What only the SQLite store has: its durability settings and its schema's version (the store contract, which it
shares with PostgreSQL: test_store.py)."""

from __future__ import annotations

import sqlite3

import pytest

from appliance.batch.sqlite import SCHEMA_VERSION, SchemaError, SQLiteBatchStore


@pytest.fixture
def store(tmp_path):
    store = SQLiteBatchStore(tmp_path / "batch.sqlite3")
    yield store
    store.close()


def test_the_database_is_durable_by_construction(store):
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: each commit is on disk
    assert store._db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_newer_schema_is_refused_and_the_same_one_reopens(tmp_path):
    path = tmp_path / "batch.sqlite3"
    SQLiteBatchStore(path).close()
    SQLiteBatchStore(path).close()  # opening again migrates nothing and keeps the data
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(SchemaError, match="newer"):
        SQLiteBatchStore(path)
