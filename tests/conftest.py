"""Shared fixtures: the demo model is built once per code version and reused across runs and test modules."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _model_code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted((REPO / "appliance" / "model").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@pytest.fixture(scope="session")
def demo_models_dir() -> Path:
    """Where demo models for tests live: keyed by the model code's hash, so a code change rebuilds them."""
    root = Path(os.environ.get("APPLIANCE_TEST_CACHE", REPO / "var" / "test-cache"))
    return root / f"models-{_model_code_hash()}"


@pytest.fixture(scope="session")
def demo_model_int8(demo_models_dir: Path) -> Path:
    """The INT8 (W8A8) demo model, as `appliance up` builds it."""
    from appliance.cli.serve import ensure_demo_model

    return ensure_demo_model(demo_models_dir)


@pytest.fixture(scope="session")
def demo_model_bf16(demo_model_int8: Path) -> Path:
    return demo_model_int8.with_name("demo-bf16")


@pytest.fixture(autouse=True)
def _no_host_probe_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apps built in-process by unit tests skip the start-up bandwidth/FLOP probe (collectors.probe_bandwidth): it
    measured nothing those tests check and cost each app build up to seconds, over a hundred builds a run. Its own
    tests (tests/collectors) ask for it explicitly, and real appliances (engine- and compose-marked tests, whose
    harness passes no APPLIANCE_ variable of this process on) probe as in production."""
    if request.node.get_closest_marker("engine") is None and request.node.get_closest_marker("compose") is None:
        monkeypatch.setenv("APPLIANCE_COLLECTORS__PROBE_BANDWIDTH", "false")
        # Nor do they run batches: an app on the default state_dir (./var) would resume the batches a local
        # `appliance up` left there, against the test's fake engines. The Batch API's own tests turn it on.
        monkeypatch.setenv("APPLIANCE_BATCH__ENABLED", "false")


@pytest.fixture
def stubs():
    """Two fake vLLM engines (tests/fake_engine.py) for the gateway's and maintenance's unit tests (never what a test
    claims to verify about serving: that is tests/integration, on real engines). Every answer is three tokens, "0",
    "1" and "2" when streamed, "hello" when whole, so a test can tell what it was relayed."""
    from tests.fake_engine import CountingModel, FakeEngine

    engines = [FakeEngine(model=CountingModel(prefix="", whole_text="hello"), tokens=3).start() for _ in range(2)]
    yield engines
    for engine in engines:
        engine.stop()
