import pytest

from appliance.engine.placement import PlacementError, count_gpus, detect_device, plan_placements


def test_cpu_replicas_get_disjoint_core_slices():
    placements = plan_placements(2, "cpu", cores=[0, 1, 2, 3])
    assert [p.cores for p in placements] == [(0, 1), (2, 3)]
    assert placements[0].env() == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}


def test_cpu_oversubscription_shares_all_cores():
    placements = plan_placements(3, "cpu", cores=[0, 1])
    assert all(p.cores == (0, 1) for p in placements)


def test_gpu_replicas_get_disjoint_devices_with_tensor_parallelism():
    placements = plan_placements(2, "cuda", tensor_parallel_size=2, gpu_count=4)
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in placements] == ["0,1", "2,3"]


def test_too_few_gpus_is_an_error():
    with pytest.raises(PlacementError, match="need 4 GPUs; 2 visible"):
        plan_placements(2, "cuda", tensor_parallel_size=2, gpu_count=2)


def test_without_nvml_auto_means_cpu(monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert count_gpus() == 0
    assert detect_device("auto") == "cpu"
    assert detect_device("cuda") == "cuda"
