"""Grafana annotations of maintenance actions, so a restart shows up on every dashboard's time line.

One POST to Grafana's HTTP API (``/api/annotations``) per action, in the background: a failure (Grafana down, a
bad token) is logged and counted, and never reaches the action it describes. aiohttp, the server's one async
HTTP client, does it in a few lines; a Grafana client library would bring its own HTTP stack into the engines'
environment.

Bounded whatever happens upstream: one HTTP client (one connection pool) for every annotation, one sender that
posts them in order, and at most ``max_pending`` waiting. A burst beyond that (a flood of alerts, Grafana slow)
drops the newest, counts them in ``dropped`` and logs once per burst: annotations are a view, never a queue that
grows with what an attacker sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 32


class Annotator:
    """Posts annotations when a Grafana URL is configured; a no-op otherwise."""

    def __init__(self, url: str | None, token: str | None = None, token_file: Path | None = None, *,
                 timeout_seconds: float = 5.0, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.enabled = bool(url)
        self._url = (url or "").rstrip("/")
        self._token = token
        self._token_file = token_file
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._max_pending = max_pending
        self._pending: deque[dict[str, Any]] = deque()
        self._sender: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._dropped_in_burst = 0
        self._failing = False  # the last post failed: further failures are logged at debug until one succeeds
        self.failures = 0
        self.dropped = 0

    def annotate(self, text: str, tags: list[str]) -> None:
        """Fire and forget; call from the event loop."""
        if not self.enabled:
            return
        if len(self._pending) >= self._max_pending:
            self.dropped += 1
            self._dropped_in_burst += 1
            if self._dropped_in_burst == 1:
                log.warning("Grafana annotations: %d waiting already; dropping the newest until they are sent",
                            len(self._pending))
            return
        self._pending.append({"time": int(time.time() * 1000), "tags": ["appliance", *tags], "text": text})
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_pending(), name="grafana-annotations")

    async def flush(self) -> None:
        """Wait until every pending annotation is sent (or failed)."""
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send_pending(self) -> None:
        while self._pending:
            await self._post(self._pending.popleft())
        if self._dropped_in_burst:
            log.warning("Grafana annotations: %d dropped in that burst (%d in all)", self._dropped_in_burst,
                        self.dropped)
            self._dropped_in_burst = 0

    async def _post(self, body: dict[str, Any]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(f"{self._url}/api/annotations", json=body,
                                          headers=self._headers()) as response:
                response.raise_for_status()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:  # best effort by design
            self.failures += 1
            log.log(logging.DEBUG if self._failing else logging.WARNING, "Grafana annotation failed (%s): %s "
                    "(%d failed in all; further failures are logged at debug until one succeeds)",
                    type(exc).__name__, exc, self.failures)
            self._failing = True
        else:
            self._failing = False

    def _headers(self) -> dict[str, str]:
        token = self._token_file.read_text().strip() if self._token_file else self._token
        return {"Authorization": f"Bearer {token}"} if token else {}
