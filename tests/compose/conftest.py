"""One real compose stack (CPU profile, 1 replica, Prometheus, Alertmanager) for tests/compose/test_stack.py."""

from __future__ import annotations

import time

import pytest

from tests.compose.podman import podman_service, require_podman
from tests.compose.stack import SERVICES, ComposeStack, Timings, build_images, cache_dir


@pytest.fixture(scope="session")
def compose_stack():
    require_podman("compose test")
    cache = cache_dir()
    timings = Timings()
    with podman_service(cache / "podman") as podman:
        build_images(podman, cache, timings)
        stack = ComposeStack(podman, cache / "stack")
        started = time.monotonic()
        try:
            stack.compose("up", "-d", "--no-build", *SERVICES, timeout=600)
            stack.wait_ready(timeout=900)
            timings.record("stack up to a ready gateway", started)
            yield stack
        finally:
            started = time.monotonic()
            stack.destroy()
            timings.record("stack down", started)
            (cache / "timings.txt").write_text("".join(f"{k}: {v}s\n" for k, v in timings.phases.items()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """On a failure, show what the containers logged: CI keeps no other trace of them."""
    report = yield
    stack = getattr(item, "funcargs", {}).get("compose_stack")
    if report.failed and isinstance(stack, ComposeStack):
        for service in SERVICES:
            report.sections.append((f"{service} log (tail)", stack.logs(service, tail=80)))
    return report
