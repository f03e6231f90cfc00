"""Grafana annotations: posted when configured, a no-op otherwise, failures logged and never raised."""

import asyncio

from aiohttp import web

from appliance.maintenance.annotations import Annotator


class Grafana:
    """Grafana's annotation endpoint on 127.0.0.1: records what arrives, answers like Grafana."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list[dict] = []
        self.status = status
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": await request.json(),
                              "peer": request.transport.get_extra_info("peername")})
        return web.json_response({"id": 1, "message": "Annotation added"}, status=self.status)


def annotate(grafana: Grafana | None, make, count: int = 1) -> Annotator:
    async def go() -> Annotator:
        runner = None
        if grafana is not None:
            app = web.Application()
            app.router.add_post("/api/annotations", grafana.handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            grafana.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
        annotator = make(grafana.url if grafana else None)
        try:
            for _ in range(count):
                annotator.annotate("maintenance: restart replica-0 (admin): ok", ["maintenance", "restart"])
            await annotator.close()
        finally:
            if runner is not None:
                await runner.cleanup()
        return annotator

    return asyncio.run(go())


def test_posts_text_tags_and_time_with_the_token(tmp_path):
    grafana = Grafana()
    token = tmp_path / "token"
    token.write_text("secret\n")
    annotate(grafana, lambda url: Annotator(url, token_file=token))
    (request,) = grafana.requests
    assert request["path"] == "/api/annotations"
    assert request["headers"]["Authorization"] == "Bearer secret"
    body = request["body"]
    assert body["text"].startswith("maintenance: restart replica-0")
    assert body["tags"] == ["appliance", "maintenance", "restart"]
    assert body["time"] > 1.7e12  # milliseconds


def test_a_rejected_annotation_is_counted_not_raised():
    grafana = Grafana(status=401)
    annotator = annotate(grafana, lambda url: Annotator(url, "bad-token"))
    assert annotator.failures == 1 and len(grafana.requests) == 1


def test_an_unreachable_grafana_is_counted_not_raised():
    annotator = annotate(None, lambda _url: Annotator("http://127.0.0.1:9"))
    assert annotator.failures == 1


def test_no_url_no_annotations():
    annotator = annotate(None, lambda _url: Annotator(None))
    assert not annotator.enabled and annotator.failures == 0


def test_annotations_share_one_http_client():
    """One connection for a burst: no new HTTP client (and TCP connection) per annotation."""
    grafana = Grafana()
    annotate(grafana, lambda url: Annotator(url), count=5)
    assert len(grafana.requests) == 5
    assert len({r["peer"] for r in grafana.requests}) == 1


def test_a_burst_is_bounded_and_what_is_dropped_is_counted(caplog):
    grafana = Grafana()
    annotator = annotate(grafana, lambda url: Annotator(url, max_pending=4), count=50)
    assert len(grafana.requests) == 4 and annotator.dropped == 46
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) <= 2
