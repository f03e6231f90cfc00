"""No engine process outlives the appliance, even when the appliance is killed with SIGKILL."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.harness import ApplianceProcess

pytestmark = pytest.mark.engine


def test_sigkilled_appliance_leaves_no_engine_behind(demo_model_int8, tmp_path):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path, replicas=1).start()
    try:
        app.wait_ready(timeout=300)
        engines = app.engine_processes()
        assert len(engines) >= 3  # launcher, vLLM API server, engine core
    finally:
        app.stop(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while app.leftover_engine_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert app.leftover_engine_processes() == []
