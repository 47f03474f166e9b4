"""The pure parts of bench/gpu_profile.py: which rows its difference and attribution tables show.
(Its code paths as a whole run in tests/distributed/test_gpu_bench_smoke.py.)"""

from __future__ import annotations

import types

from torch.autograd import DeviceType

from bench import gpu_profile


def event(key: str, count: int, cpu_total_us: float, self_cpu_us: float = 0.0, device=DeviceType.CPU):
    return types.SimpleNamespace(
        key=key, count=count, cpu_time_total=cpu_total_us, self_cpu_time_total=self_cpu_us, device_type=device
    )


def test_largest_differences_orders_by_absolute_difference_and_counts_missing_keys_as_zero():
    unpacked = {"aten::mm": (10.0, 5.0), "aten::add": (4.0, 1.0), "aten::copy_": (2.0, 3.0)}
    packed = {"aten::mm": (10.0, 5.5), "aten::add": (4.0, 0.2), "aten::_flash_attention_forward": (2.0, 9.0)}
    rows = gpu_profile.largest_differences(unpacked, packed, rows=3)
    assert [r[0] for r in rows] == ["aten::_flash_attention_forward", "aten::copy_", "aten::add"]
    flash, copy, add = rows
    assert flash[1:] == (0.0, 2.0, 9.0)
    assert copy[1:] == (2.0, 0.0, -3.0)
    assert abs(add[3] - (-0.8)) < 1e-12


def test_runtime_rows_keep_cuda_api_calls_per_step_heaviest_first():
    events = [
        event("cudaLaunchKernel", 600, 3000.0),
        event("cudaMalloc", 4, 9000.0),
        event("aten::mm", 100, 50000.0),
        event("cudaStreamSynchronize", 8, 1000.0),
        event("cudaMemcpyAsync", 2, 10.0, device=DeviceType.CUDA),
    ]
    rows = gpu_profile.runtime_rows(events, steps=2)
    assert rows == [("cudaMalloc", 2.0, 4.5), ("cudaLaunchKernel", 300.0, 1.5), ("cudaStreamSynchronize", 4.0, 0.5)]


def test_host_ms_by_key_uses_self_time_of_host_events():
    events = [event("aten::linear", 4, 10000.0, self_cpu_us=2000.0), event("kernel", 4, 0.0, 0.0, DeviceType.CUDA)]
    assert gpu_profile.host_ms_by_key(events, steps=2) == {"aten::linear": (2.0, 1.0)}


def test_python_groups_name_the_package_and_the_c_calls():
    group = gpu_profile.python_group
    site = "/usr/lib/python3.12/site-packages"
    assert group(f"{site}/megatron/core/transformer/attention.py", "forward") == "megatron.core/transformer"
    assert group(f"{site}/torch/nn/modules/module.py", "_call_impl") == "torch/nn"
    assert group("/work/main/megatron_ext/model/attention.py", "forward") == "megatron_ext/model/attention.py"
    assert group("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>").startswith("C: autograd engine")
    assert group("~", "<built-in method torch.matmul>") == "C: torch operators called from Python"
    assert group("~", "<method 'add_' of 'torch._C.TensorBase' objects>") == "C: torch operators called from Python"
    assert group("~", "<built-in method builtins.isinstance>") == "C: other builtins"
    assert group("/usr/lib/python3.12/contextlib.py", "__enter__") == "contextlib.py"
    assert (
        gpu_profile.function_label((f"{site}/megatron/core/transformer/attention.py", 875, "forward"))
        == "megatron.core/transformer/attention.py:875(forward)"
    )
