"""The engine-load parser: the few vLLM lines routing needs, picked out of a whole /metrics page."""

import math

from appliance.engine.load import parse_engine_load

PAGE = b"""# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.25
vllm:num_requests_waiting{engine="0",model_name="demo"} 3.0
vllm:num_requests_running{engine="0",model_name="demo"} 2.0
vllm:num_requests_running{engine="1",model_name="demo"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="demo"} 1234.0
vllm:generation_tokens_total{engine="0",model_name="demo"} 5678.0
vllm:generation_tokens_created{engine="0",model_name="demo"} 1.7e9
vllm:num_requests_running_other 99
process_cpu_seconds_total 12.5
"""


def test_the_wanted_gauges_summed_over_label_sets() -> None:
    load = parse_engine_load(PAGE, read_at=42.0)
    assert load.kv_cache_usage == 0.25
    assert load.waiting == 3.0
    assert load.running == 3.0  # two engine cores of one server
    assert load.prompt_tokens_total == 1234.0
    assert load.generation_tokens_total == 5678.0
    assert load.read_at == 42.0


def test_absent_metrics_are_unknown_not_zero() -> None:
    load = parse_engine_load(b"process_cpu_seconds_total 1\n", read_at=1.0)
    assert load.kv_cache_usage is None and load.waiting is None and load.running is None


def test_garbage_lines_are_skipped() -> None:
    page = (b"vllm:kv_cache_usage_perc{engine=\"0\"} not-a-number\n"
            b"vllm:num_requests_waiting\n"
            b"vllm:num_requests_running 4\n")
    load = parse_engine_load(page, read_at=0.0)
    assert load.kv_cache_usage is None and load.waiting is None and load.running == 4.0


def test_the_default_reading_is_infinitely_old() -> None:
    from appliance.engine.load import EngineLoad

    assert EngineLoad().read_at == -math.inf


CACHE_INFO = (b'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
              b'engine="%s",num_gpu_blocks="%s",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"}'
              b' 1.0\n')


def test_kv_capacity_is_blocks_times_block_size_from_the_cache_config_labels() -> None:
    load = parse_engine_load(PAGE + CACHE_INFO % (b"0", b"300"), read_at=1.0)
    assert load.kv_capacity_tokens == 300 * 128
    assert load.kv_cache_usage == 0.25  # the same one scan still reads the gauges


def test_kv_capacity_is_not_summed_over_data_parallel_engines() -> None:
    """vLLM already sums num_gpu_blocks over data-parallel engines and repeats the labels per engine."""
    page = CACHE_INFO % (b"0", b"600") + CACHE_INFO % (b"1", b"600")
    assert parse_engine_load(page, read_at=1.0).kv_capacity_tokens == 600 * 128


def test_kv_capacity_is_unknown_before_the_engine_sized_its_cache() -> None:
    assert parse_engine_load(PAGE, read_at=1.0).kv_capacity_tokens is None
    assert parse_engine_load(CACHE_INFO % (b"0", b"None"), read_at=1.0).kv_capacity_tokens is None
