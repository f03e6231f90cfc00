"""Grafana annotations of maintenance actions, so a restart shows up on every dashboard's time line.

One POST to Grafana's HTTP API (``/api/annotations``) per action, in the background: a failure (Grafana down, a
bad token) is logged and counted, and never reaches the action it describes. aiohttp, the server's one async
HTTP client, does it in a few lines; a Grafana client library would bring its own HTTP stack into the engines'
environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import aiohttp

log = logging.getLogger(__name__)


class Annotator:
    """Posts annotations when a Grafana URL is configured; a no-op otherwise."""

    def __init__(self, url: str | None, token: str | None = None, token_file: Path | None = None, *,
                 timeout_seconds: float = 5.0) -> None:
        self.enabled = bool(url)
        self._url = (url or "").rstrip("/")
        self._token = token
        self._token_file = token_file
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._tasks: set[asyncio.Task] = set()
        self.failures = 0

    def annotate(self, text: str, tags: list[str]) -> None:
        """Fire and forget; call from the event loop."""
        if not self.enabled:
            return
        body = {"time": int(time.time() * 1000), "tags": ["appliance", *tags], "text": text}
        task = asyncio.get_running_loop().create_task(self._post(body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _post(self, body: dict) -> None:
        try:
            async with aiohttp.ClientSession(timeout=self._timeout) as session, \
                    session.post(f"{self._url}/api/annotations", json=body, headers=self._headers()) as response:
                response.raise_for_status()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:  # best effort by design
            self.failures += 1
            log.warning("Grafana annotation failed (%s): %s", type(exc).__name__, exc)

    def _headers(self) -> dict[str, str]:
        token = self._token_file.read_text().strip() if self._token_file else self._token
        return {"Authorization": f"Bearer {token}"} if token else {}
