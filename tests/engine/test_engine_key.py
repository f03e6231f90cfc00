"""Engines answer only the gateway: the engine key (VLLM_API_KEY) on every engine, checked by vLLM on /v1 and by
the appliance's own middleware everywhere else but /health and /metrics; the gateway, the warm-up request and
nothing else hold it; it never shows on a command line or in `appliance config`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from appliance.engine.command import ENGINE_GUARD, engine_argv
from appliance.engine.guard import ENGINE_KEY_ENV, EngineKeyGuard, engine_authorization
from appliance.engine.settings import EngineSettings
from appliance.maintenance.controller import http_warmer
from appliance.serve import engine_extra_env, with_engine_key
from appliance.settings import Settings
from tests.doubles import FakeReplica
from tests.fake_engine import FakeEngine

KEY = "engine-k3y"
PATHS = ("/v1/completions", "/invocations", "/tokenize", "/pause", "/health", "/metrics")


def _app(**guard: str | None) -> TestClient:
    async def ok(_request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(path, ok, methods=["GET", "POST"]) for path in PATHS])
    app.add_middleware(EngineKeyGuard, **guard)
    return TestClient(app)


def test_the_guard_refuses_every_path_but_health_and_metrics_without_the_key() -> None:
    client = _app(key=KEY)
    for path in PATHS:
        refused = client.post(path)
        wrong = client.post(path, headers={"authorization": "Bearer nope"})
        right = client.post(path, headers={"authorization": f"Bearer {KEY}"})
        assert right.status_code == 200, path
        if path in ("/health", "/metrics"):  # the gateway's probe and poll, Prometheus' scrape
            assert refused.status_code == wrong.status_code == 200, path
        else:
            assert refused.status_code == wrong.status_code == 401, path
            assert refused.json() == {"error": "Unauthorized"}  # vLLM's own answer


def test_the_guard_reads_vllms_variable_and_lets_all_through_without_one(monkeypatch) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    assert _app().post("/invocations").status_code == 401
    monkeypatch.delenv(ENGINE_KEY_ENV)
    assert _app().post("/invocations").status_code == 200  # as vLLM without --api-key


def test_the_guard_says_the_scheduling_policy_vllm_runs_on_metrics_answers() -> None:
    """From vLLM's own configuration in its app's state (app.state.vllm_config), on /metrics only; an app without
    it (not a vLLM server, or one not configured yet) says nothing."""
    from types import SimpleNamespace

    client = _app(key=KEY)
    assert "x-appliance-scheduling-policy" not in client.get("/metrics").headers
    client.app.state.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(policy="priority"))
    assert client.get("/metrics").headers["x-appliance-scheduling-policy"] == "priority"
    assert "x-appliance-scheduling-policy" not in client.get("/health").headers
    assert client.post("/invocations").status_code == 401  # the door is as it was


def test_the_command_line_names_the_guard_and_never_holds_the_key() -> None:
    argv = engine_argv(Path("/m"), "demo", 8100, EngineSettings(max_model_len=512))
    assert argv[argv.index("--middleware") + 1] == ENGINE_GUARD == "appliance.engine.guard.EngineKeyGuard"
    assert "--api-key" not in argv  # /proc/<pid>/cmdline is world-readable; the key goes by VLLM_API_KEY
    settings = Settings(gateway={"engine_key": KEY})
    assert engine_extra_env(settings)[ENGINE_KEY_ENV] == KEY
    assert ENGINE_KEY_ENV not in engine_extra_env(Settings())


@pytest.fixture
def root_log_level():
    """vLLM's build_app sets the root logger's level (to ERROR): given back after the test, or every later test
    that reads a WARNING through caplog sees nothing."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


def test_vllm_builds_its_server_with_the_guard_and_guards_only_v1_without_it(monkeypatch, root_log_level) -> None:
    """vLLM 0.32's own app from the appliance's command line: its --api-key guards /v1 (GUARDED_PREFIX in
    vllm/entrypoints/serve/middleware/authenticate.py) but leaves /invocations, the same completions for
    SageMaker, and /tokenize open; with the guard both answer 401 too, /metrics still 200."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    argv = engine_argv(Path("/m"), "demo", 8100, EngineSettings(max_model_len=512))

    def statuses(command: list[str]) -> dict[str, int]:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(command)
        client = TestClient(build_app(args, supported_tasks=("generate",)), raise_server_exceptions=False)
        return {path: client.post(path, json={}).status_code for path in ("/v1/completions", "/invocations",
                                                                           "/tokenize")} | {
            "/metrics": client.get("/metrics").status_code}

    guarded = statuses(argv)
    assert guarded == {"/v1/completions": 401, "/invocations": 401, "/tokenize": 401, "/metrics": 200}
    alone = statuses(argv[:argv.index("--middleware")])
    assert alone["/v1/completions"] == 401 and alone["/invocations"] != 401 and alone["/tokenize"] != 401


def test_an_appliance_running_its_engines_makes_a_key_of_its_own_each_run() -> None:
    first, second = with_engine_key(Settings()), with_engine_key(Settings())
    assert first.gateway.engine_key and second.gateway.engine_key
    assert first.gateway.engine_key != second.gateway.engine_key and len(first.gateway.engine_key) >= 40
    assert with_engine_key(Settings(gateway={"engine_key": KEY})).gateway.engine_key == KEY


def test_engines_run_elsewhere_get_the_configured_key_or_none(caplog) -> None:
    """Gateway pods and nodes cannot share a key one of them made up: only a configured one (a Secret)."""
    external = Settings(discovery={"engine_urls": ["http://e:8100"]})
    assert with_engine_key(external).gateway.engine_key is None
    gateway = Settings(role="gateway", discovery={"name": "engines"})
    assert with_engine_key(gateway).gateway.engine_key is None
    with caplog.at_level(logging.WARNING, logger="appliance.serve"):
        node = with_engine_key(Settings(role="node"))
    assert node.gateway.engine_key is None and "engine_key_file" in caplog.text
    assert with_engine_key(Settings(role="node", gateway={"engine_key": KEY})).gateway.engine_key == KEY


def test_the_warm_up_request_carries_the_engine_key() -> None:
    async def scenario() -> tuple[bool, bool]:
        async with FakeEngine(api_key=KEY) as engine:
            replica = FakeReplica("replica-0", engine.url)
            without = await http_warmer("demo", "Hello", 2)(replica)
            with_key = await http_warmer("demo", "Hello", 2, headers=engine_authorization(KEY))(replica)
            return without, with_key

    assert asyncio.run(scenario()) == (False, True)
