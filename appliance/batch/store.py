"""The Batch API's storage, as a Protocol: SQLite for one host (``sqlite.py``), PostgreSQL for several gateways
sharing batches (``postgres.py``); both run the same statements (``sql.py``).

Every method is one transaction, so a process killed at any moment leaves each batch as it was before the call or
after it. Two guarantees the rest relies on:

- a line's result is recorded once: ``record_results`` writes only lines still pending, and says which it wrote,
  so a line answered twice (sent again after a crash, or while its batch expired) lands in its file once;
- status changes are guarded (``transition`` names the statuses it moves from), so two writers (the API's cancel,
  the runner's completion) cannot both win.

``tenant`` arguments scope a read or delete to one tenant (None: every tenant, for the admin view).

A shared store adds a third: a line taken to be sent (``pending_lines`` with a limit) is claimed, so no two gateways
send it at once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from appliance.batch.model import BatchRecord, FileRecord, LineInput, LineResult, PendingLine, Status, Summary


class StoreUnavailable(RuntimeError):
    """A server database cannot be reached now (the message names it, never its credentials): the call did
    nothing, and may be made again."""


class BatchStore(Protocol):
    # -- files ----------------------------------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None: ...

    def get_file(self, file_id: str, tenant: str | None) -> FileRecord | None: ...

    def list_files(self, tenant: str, *, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> list[FileRecord]:
        """Files ordered by creation (then id), from just past ``after`` (an id), at most ``limit``."""
        ...

    def delete_file(self, file_id: str, tenant: str) -> FileRecord | None:
        """Forget the file; returns what was forgotten (None: no such file of this tenant)."""
        ...

    def expired_files(self, created_by: int, limit: int) -> list[FileRecord]:
        """Files created at or before ``created_by``, oldest first, except the input file of a batch not yet
        ended (its lines are read from the database, but its file is what the client named)."""
        ...

    def forget_files(self, file_ids: Collection[str]) -> None:
        """Drop these files' records (before their blobs are removed: a crash between the two leaves only an
        unrecorded blob, which ``FileBlobs.sweep`` removes at start)."""
        ...

    def file_ids(self) -> set[str]:
        """Every file the store knows: what is on disk and not here is an orphan of a crash."""
        ...

    # -- batches --------------------------------------------------------------------------------------------------

    def create_batch(self, batch: BatchRecord, lines: Sequence[LineInput]) -> None:
        """The batch and all its lines at once; lines with a result (malformed) count as failed already."""
        ...

    def get_batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None: ...

    def list_batches(self, tenant: str | None, *, status: Status | None, after: str | None,
                     limit: int) -> list[BatchRecord]:
        """Newest first, from just past ``after`` (an id), at most ``limit``."""
        ...

    def active_batches(self) -> list[BatchRecord]:
        """Batches not ended, oldest first: the runner's work."""
        ...

    def transition(self, batch_id: str, to: Status, at: int, *, sources: Collection[Status],
                   outcome: Status | None = None) -> BatchRecord | None:
        """Move the batch to ``to`` (stamping ``<to>_at``) if its status is one of ``sources``; ``outcome``: what a
        finalizing or cancelling batch will end as. Returns the batch as it is now, or None if it did not move."""
        ...

    def finish(self, batch_id: str, to: Status, at: int, *, output: FileRecord | None, error: FileRecord | None,
               errors: list[dict[str, object]] | None = None) -> BatchRecord | None:
        """End a finalizing or cancelling batch: its result files recorded (None: no line went to that file), its
        status set and its lines dropped (their results are in the files), in one transaction. None: the batch was
        not finalizing or cancelling."""
        ...

    def fail(self, batch_id: str, at: int, errors: list[dict[str, object]]) -> BatchRecord | None:
        """A validating or in-progress batch that cannot go on: ``failed`` with ``errors``, its lines dropped.
        None: the batch was not running."""
        ...

    # -- lines ----------------------------------------------------------------------------------------------------

    def pending_lines(self, batch_id: str, *, now: float, exclude: Collection[int], limit: int | None
                      ) -> list[PendingLine]:
        """Lines not yet answered and not waiting for a retry at ``now``, in input order, leaving out ``exclude``
        (this process's lines in flight); all of them when ``limit`` is None. With a limit they are to be sent: a
        store shared by several gateways claims them for this process and leaves out those another holds."""
        ...

    def release(self, batch_id: str, indexes: Sequence[int]) -> None:
        """Lines this process took and gave back unanswered (preempted, no room): a shared store lets another
        gateway take them at once. A store of one process has nothing to do."""
        ...

    def record_results(self, batch_id: str, results: Sequence[tuple[int, LineResult]]) -> list[int]:
        """Record each line's result if it is still pending, with the batch's counts and usage; returns the lines
        it recorded (a line answered already is left as it was)."""
        ...

    def defer_line(self, batch_id: str, index: int, *, attempts: int, not_before: float) -> None:
        """A line that failed with a server error: tried ``attempts`` times, not sent again before ``not_before``."""
        ...

    def results(self, batch_id: str, kind: str) -> list[str]:
        """The result lines of one file (output or error), in input order."""
        ...

    def summary(self) -> Summary: ...

    def close(self) -> None: ...
