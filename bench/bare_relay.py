"""The floor of the gateway's libraries: a relay built from what the gateway's transport is built from (uvicorn
with httptools and uvloop on the client side, an aiohttp session to the engine) and nothing else: no intake, no
admission, no hooks, no Starlette. Every request is forwarded as it came; the answer's bytes go back read by read.

bench/stream_overhead.py runs it as the path ``bare`` (``--paths direct,gateway,bare,vllm-router``): the gateway's
CPU per event against this is what the appliance's own code costs; this against vllm-router is what Python and
these libraries cost. Not a product: it knows one upstream, checks nothing and is never deployed.

    .venv/bin/python bench/bare_relay.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length"})


class BareRelay:
    """A raw ASGI app: one aiohttp session, opened at startup."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in HOP_BY_HOP}
        assert self.session is not None
        async with self.session.request(scope["method"], self.upstream + scope["path"], data=body or None,
                                        headers=headers) as answer:
            out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower().encode() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": answer.status, "headers": out})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                     timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(BareRelay(upstream), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, backlog=2048)


if __name__ == "__main__":
    main()
