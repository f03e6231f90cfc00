"""Session fixtures: one demo model build and one INT8 quantization shared by every model test.

The tests build a shorter-trained demo model than `appliance up` does (a fixed step cap, so it is still
deterministic): the quantizer's quality bar (top-1 agreement >= 0.9) depends on quantization error, not on
how good the model is, and the short build keeps the suite fast on a 2-core host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.model.demo import build_demo_model
from appliance.model.quantize import quantize_checkpoint

TEST_MAX_STEPS = 80  # ~10 s on an idle 2-core host
# Generous so the step cap (and so a reproducible model) is reached even while other test suites load the host.
TEST_TRAIN_SECONDS = 300.0


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "demo-bf16"
    summary = build_demo_model(out, max_steps=TEST_MAX_STEPS, train_seconds=TEST_TRAIN_SECONDS)
    return out, summary


@pytest.fixture(scope="session")
def demo_model_dir(demo_build: tuple[Path, dict]) -> Path:
    """The bf16 demo checkpoint (treat as read-only: copy it before modifying)."""
    return demo_build[0]


@pytest.fixture(scope="session")
def demo_summary(demo_build: tuple[Path, dict]) -> dict:
    return demo_build[1]


@pytest.fixture(scope="session")
def quantized(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(INT8 checkpoint dir, quantize_checkpoint's report) for the demo model, quality check included."""
    dst = tmp_path_factory.mktemp("int8") / "demo-int8"
    return dst, quantize_checkpoint(demo_model_dir, dst)


@pytest.fixture(scope="session")
def quantized_fp8(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(FP8 W8A8 checkpoint dir, quantize_checkpoint's report) for the demo model, quality check included."""
    dst = tmp_path_factory.mktemp("fp8") / "demo-fp8"
    return dst, quantize_checkpoint(demo_model_dir, dst, scheme="fp8")
