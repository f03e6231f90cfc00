"""engine.kv_cache_dtype through a real appliance: the engine it starts stores its KV cache in fp8, holding the
tokens the planner and the shape reader compute for the same KV space, and serves."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.model.shape import load_model_shape
from tests.integration.harness import ApplianceProcess

GIB = 2**30


def cache_config(engine_url: str) -> dict[str, str]:
    """The labels of vLLM's vllm:cache_config_info (its CacheConfig, as the engine resolved it)."""
    page = httpx.get(f"{engine_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(page):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("the engine exports no vllm:cache_config_info")


@pytest.mark.engine
def test_fp8_kv_cache_holds_twice_the_tokens(demo_model_int8: Path, tmp_path: Path) -> None:
    app = ApplianceProcess(model=demo_model_int8, state_dir=tmp_path / "appliance", replicas=1,
                           env={"APPLIANCE_ENGINE__KV_CACHE_DTYPE": "fp8", "APPLIANCE_ENGINE__MAX_NUM_SEQS": "8"})
    app.start()
    try:
        app.wait_ready(timeout=600)
        config = cache_config(f"http://127.0.0.1:{app.engine_port(0)}")
        shape = load_model_shape(demo_model_int8)
        block = int(config["block_size"])
        assert config["cache_dtype"] == "fp8"
        # 1 GiB of KV space (the harness' kv_cache_space_gib) at one byte per element: twice the blocks of 16-bit
        assert int(config["num_gpu_blocks"]) == GIB // (block * shape.kv_bytes_per_token(1))
        assert int(config["num_gpu_blocks"]) == 2 * (GIB // (block * shape.kv_bytes_per_token()))
        reply = httpx.post(f"{app.url}/v1/completions", timeout=120, json={
            "model": "demo", "prompt": "The class statement", "max_tokens": 16, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 16
    finally:
        code = app.stop(signal.SIGTERM)
    assert code == 0, app.log_tail()
    assert app.leftover_engine_processes() == []
