"""One real appliance (2 vLLM CPU replicas, INT8 demo model) shared by the integration tests.

Test files run in name order; test_serving.py ends with the drain test, which stops the shared appliance, so it
must stay the last user of the fixture (its name sorts last on purpose).
"""

from __future__ import annotations

import signal

import openai
import pytest

from tests.integration.harness import ApplianceProcess


@pytest.fixture(scope="session")
def appliance(demo_model_int8, tmp_path_factory):
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path_factory.mktemp("appliance"), replicas=2)
    app.start()
    try:
        app.wait_ready(timeout=400)
        yield app
    finally:
        app.stop(signal.SIGKILL if app.proc.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="session")
def client(appliance):
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="unused", max_retries=0, timeout=60)
