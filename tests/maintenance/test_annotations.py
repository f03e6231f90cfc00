"""Grafana annotations: posted when configured, a no-op otherwise, failures logged and never raised."""

import asyncio
import json

import httpx

from appliance.maintenance.annotations import Annotator


class Grafana:
    """Grafana's annotation endpoint as an httpx transport: records what arrives, answers like Grafana."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list[httpx.Request] = []
        self.status = status

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return httpx.Response(self.status, json={"id": 1, "message": "Annotation added"})

        return httpx.MockTransport(handle)


def annotate(annotator: Annotator) -> None:
    async def go() -> None:
        annotator.annotate("maintenance: restart replica-0 (admin): ok", ["maintenance", "restart"])
        await annotator.flush()

    asyncio.run(go())


def test_posts_text_tags_and_time_with_the_token(tmp_path):
    grafana = Grafana()
    token = tmp_path / "token"
    token.write_text("secret\n")
    annotate(Annotator("http://grafana:3000/", token_file=token, transport=grafana.transport()))
    (request,) = grafana.requests
    assert str(request.url) == "http://grafana:3000/api/annotations"
    assert request.headers["authorization"] == "Bearer secret"
    body = json.loads(request.content)
    assert body["text"].startswith("maintenance: restart replica-0")
    assert body["tags"] == ["appliance", "maintenance", "restart"]
    assert body["time"] > 1.7e12  # milliseconds


def test_a_rejected_annotation_is_counted_not_raised():
    grafana = Grafana(status=401)
    annotator = Annotator("http://grafana:3000", "bad-token", transport=grafana.transport())
    annotate(annotator)
    assert annotator.failures == 1 and len(grafana.requests) == 1


def test_no_url_no_annotations():
    annotator = Annotator(None)
    annotate(annotator)
    assert not annotator.enabled and annotator.failures == 0


def test_unreachable_grafana_is_only_logged():
    annotator = Annotator("http://127.0.0.1:9", "token", timeout_seconds=1)
    annotate(annotator)
    assert annotator.failures == 1
