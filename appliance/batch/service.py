"""The Batch API's operations (OpenAI's /v1/files and /v1/batches), per tenant: what the routes call.

Each answer is JSON-ready (OpenAI's File, Batch and list objects); every refusal is an ``APIError`` with the status
OpenAI gives it, so the routes only move values. A tenant sees only its own files and batches: another tenant's id
is answered as unknown (404), never as forbidden, so ids reveal nothing. ``tenant=None`` is the operator's view
(the admin routes, ``appliance batches``).

Storage work (database commits with fsync, file writes, reading and checking an input file of up to
``batch.max_file_bytes``) runs on one thread of its own (``Storage``), never on the gateway's event loop, where it
would hold up every stream's next token.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from appliance.batch.blobs import FileBlobs
from appliance.batch.lines import Rules, read_lines
from appliance.batch.model import (
    ENDPOINTS,
    PURPOSE,
    RUNNING,
    BatchRecord,
    FileRecord,
    Status,
    new_batch_id,
    new_file_id,
)
from appliance.batch.settings import BatchSettings
from appliance.batch.sqlite import SQLiteBatchStore
from appliance.batch.store import BatchStore, StoreUnavailable
from appliance.http.errors import APIError

T = TypeVar("T")
MAX_PAGE = 100
MAX_FILENAME = 255
WINDOW = re.compile(r"^([1-9][0-9]{0,4})h$")
STORE_RETRY_AFTER = 5  # seconds: a 503 batch_store_unavailable's Retry-After
# A shared files folder: a file written by another gateway is recorded right after (an upload's, a result file's
# write and record are one storage call); ten minutes is far beyond that, and an orphan waits at most that long.
SHARED_SWEEP_GRACE_SECONDS = 600.0


class Storage:
    """The store and the files on disk, used from one thread of their own. The database is opened on first need
    (an SQLite file is created only by a write: an appliance that never saw a batch writes nothing); the first open
    removes files a crash left unrecorded.

    ``database``: an SQLite file's path (opened with ``open_store``), or what opens a server database's store
    (PostgreSQL: several gateways share it and the files folder). A shared folder may hold a file another gateway
    is writing and has not yet recorded: the sweep leaves files younger than ``SHARED_SWEEP_GRACE_SECONDS``."""

    def __init__(self, database: Path | Callable[[], BatchStore], files: Path,
                 open_store: Callable[[Path], BatchStore] = SQLiteBatchStore) -> None:
        self.database = database
        self.blobs = FileBlobs(files)
        self._open_store: Callable[[], BatchStore] = (functools.partial(open_store, database)
                                                      if isinstance(database, Path) else database)
        self._store: BatchStore | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch-storage")

    @property
    def shared(self) -> bool:
        return not isinstance(self.database, Path)

    def exists(self) -> bool:
        return self._store is not None or not isinstance(self.database, Path) or self.database.exists()

    async def call(self, work: Callable[[BatchStore, FileBlobs], T]) -> T:
        """``work(store, blobs)`` on the storage thread; a server database out of reach is a 503."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, functools.partial(self._run, work))
        except StoreUnavailable as exc:  # what failed is in the chain the logs show, not in what a client reads
            raise APIError(503, "the batch database cannot be reached now; try again shortly",
                           code="batch_store_unavailable", headers={"Retry-After": str(STORE_RETRY_AFTER)}) from exc

    def _run(self, work: Callable[[BatchStore, FileBlobs], T]) -> T:
        if self._store is None:
            self._store = self._open_store()
            self.blobs.sweep(self._store.file_ids(), younger_kept=SHARED_SWEEP_GRACE_SECONDS if self.shared else 0)
        return work(self._store, self.blobs)

    def close(self) -> None:
        def close() -> None:
            if self._store is not None:
                self._store.close()
                self._store = None
        self._executor.submit(close).result()
        self._executor.shutdown()


class BatchService:
    def __init__(self, settings: BatchSettings, storage: Storage, *, served_model: str | None,
                 max_model_len: int | None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.storage = storage
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.clock = clock
        self.on_change: Callable[[], None] = lambda: None  # the runner's wake-up: a batch was created or cancelled

    @property
    def retention_seconds(self) -> int:
        return self.settings.file_retention_hours * 3600

    def _now(self) -> int:
        return int(self.clock())

    # -- files ----------------------------------------------------------------------------------------------------

    async def upload(self, tenant: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        if purpose != PURPOSE:
            raise APIError(400, f"purpose {purpose!r} is not supported: this appliance takes files for the Batch "
                                f"API only (purpose \"{PURPOSE}\")", param="purpose", code="invalid_purpose")
        if len(data) > self.settings.max_file_bytes:
            raise APIError(400, f"the file is {len(data)} bytes, more than the {self.settings.max_file_bytes} "
                                "this appliance accepts (batch.max_file_bytes)", param="file", code="file_too_large")
        if not data.strip():
            raise APIError(400, "the file is empty", param="file", code="empty_file")
        record = FileRecord(new_file_id(), tenant, purpose, _filename(filename), len(data), self._now())

        def store(store: BatchStore, blobs: FileBlobs) -> None:
            blobs.write(record.id, data)  # on disk first: a record never names a file that is not there
            store.add_file(record)

        await self.storage.call(store)
        return record.to_json(self.retention_seconds)

    async def files(self, tenant: str, *, purpose: str | None = None, after: str | None = None,
                    limit: int = MAX_PAGE, order: str = "desc") -> dict[str, Any]:
        if not self.storage.exists():
            return _page([], False)
        rows = await self.storage.call(lambda store, _: store.list_files(
            tenant, purpose=purpose, after=after, limit=limit + 1, newest_first=order != "asc"))
        return _page([row.to_json(self.retention_seconds) for row in rows[:limit]], len(rows) > limit)

    async def file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return (await self._file(tenant, file_id)).to_json(self.retention_seconds)

    async def content(self, tenant: str, file_id: str) -> bytes:
        record = await self._file(tenant, file_id)

        def read(_: BatchStore, blobs: FileBlobs) -> bytes | None:
            try:
                return blobs.read(record.id)
            except FileNotFoundError:
                return None

        data = await self.storage.call(read)
        if data is None:
            raise APIError(404, f"the content of {file_id} is gone from the appliance's disk", param="file_id",
                           code="file_not_found")
        return data

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        def delete(store: BatchStore, blobs: FileBlobs) -> FileRecord | None:
            record = store.delete_file(file_id, tenant)  # forgotten first: a crash leaves an orphan, swept later
            if record is not None:
                blobs.remove(record.id)
            return record

        if not self.storage.exists() or await self.storage.call(delete) is None:
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _file(self, tenant: str, file_id: str) -> FileRecord:
        record = await self.storage.call(lambda store, _: store.get_file(file_id, tenant)) \
            if self.storage.exists() else None
        if record is None:
            raise _no_file(file_id)
        return record

    # -- batches --------------------------------------------------------------------------------------------------

    async def create(self, tenant: str, *, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint {endpoint!r} is not supported; a batch runs one of "
                                f"{', '.join(sorted(ENDPOINTS))}", param="endpoint", code="invalid_endpoint")
        hours = self._window_hours(completion_window)
        if not self.storage.exists():
            raise _no_file(input_file_id)
        rules = Rules(endpoint, self.served_model, self.max_model_len, self.settings.max_lines)
        now = self._now()
        batch = BatchRecord(new_batch_id(), tenant, endpoint, input_file_id, completion_window, Status.VALIDATING,
                            created_at=now, expires_at=now + hours * 3600, model=self.served_model,
                            metadata=metadata)

        def create(store: BatchStore, blobs: FileBlobs) -> BatchRecord | None:
            record = store.get_file(input_file_id, tenant)
            if record is None:
                raise _no_file(input_file_id)
            if record.purpose != PURPOSE:
                raise APIError(400, f"file {input_file_id} has purpose {record.purpose!r}; a batch's input file "
                                    f"must have purpose \"{PURPOSE}\"", param="input_file_id", code="invalid_purpose")
            try:
                data = blobs.read(record.id)
            except FileNotFoundError:
                raise _no_file(input_file_id) from None
            store.create_batch(batch, read_lines(data, rules, batch.id))  # all checks pass before anything is kept
            return store.get_batch(batch.id, tenant)

        created = await self.storage.call(create)
        assert created is not None
        self.on_change()
        return created.to_json()

    def _window_hours(self, window: str) -> int:
        match = WINDOW.match(window)
        limit = self.settings.max_completion_window_hours
        if match is None or int(match.group(1)) > limit:
            raise APIError(400, f"completion_window {window!r} is not supported: give \"<N>h\", at most "
                                f"\"{limit}h\" (batch.max_completion_window_hours)", param="completion_window",
                           code="invalid_completion_window")
        return int(match.group(1))

    async def batch(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]:
        """``operator``: the admin view, which names each batch's tenant."""
        return (await self._batch(tenant, batch_id)).to_json(tenant=operator)

    async def batches(self, tenant: str | None, *, after: str | None = None, limit: int = 20,
                      status: str | None = None, operator: bool = False) -> dict[str, Any]:
        """Newest first; ``status``: only batches in it (the routes check it is one)."""
        if not self.storage.exists():
            return _page([], False)
        wanted = Status(status) if status is not None else None
        rows = await self.storage.call(lambda store, _: store.list_batches(tenant, status=wanted, after=after,
                                                                           limit=limit + 1))
        return _page([row.to_json(tenant=operator) for row in rows[:limit]], len(rows) > limit)

    async def cancel(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]:
        """A running batch moves to ``cancelling`` (the runner gives back its lines in flight and writes what was
        answered); cancelling one already cancelled is no error. An ended or finalizing batch: 409."""
        now = self._now()

        def cancel(store: BatchStore, _: FileBlobs) -> BatchRecord | None:
            if store.get_batch(batch_id, tenant) is None:
                return None
            moved = store.transition(batch_id, Status.CANCELLING, now, sources=RUNNING, outcome=Status.CANCELLED)
            return moved or store.get_batch(batch_id, tenant)

        record = await self.storage.call(cancel) if self.storage.exists() else None
        if record is None:
            raise _no_batch(batch_id)
        if record.status not in (Status.CANCELLING, Status.CANCELLED):
            raise APIError(409, f"batch {batch_id} is {record.status.value}: only a validating or in-progress "
                                "batch can be cancelled", param="batch_id", code="batch_not_cancellable")
        self.on_change()
        return record.to_json(tenant=operator)

    async def _batch(self, tenant: str | None, batch_id: str) -> BatchRecord:
        record = await self.storage.call(lambda store, _: store.get_batch(batch_id, tenant)) \
            if self.storage.exists() else None
        if record is None:
            raise _no_batch(batch_id)
        return record


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _filename(name: str) -> str:
    """The name as given, without any folder, bounded; kept only to be shown back."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1].strip()
    return (base or "upload.jsonl")[:MAX_FILENAME]


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"no such file: {file_id}", param="file_id", code="file_not_found")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"no such batch: {batch_id}", param="batch_id", code="batch_not_found")
