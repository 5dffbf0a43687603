"""The step profile's kernel classes and idle time, on a hand-made trace."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("profile_step", Path(__file__).parents[2] / "benchmarks/scripts/profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def _trace():
    ev = []

    def op(tid, ts, dur, name):
        ev.append({"ph": "X", "cat": "cpu_op", "tid": tid, "ts": ts, "dur": dur, "name": name})

    def kernel(corr, tid, launch_ts, ts, dur, name):
        ev.append({"ph": "X", "cat": "cuda_runtime", "tid": tid, "ts": launch_ts, "dur": 1, "name": "cudaLaunchKernel",
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "tid": 7, "ts": ts, "dur": dur, "name": name,
                   "args": {"correlation": corr}})

    op(1, 0, 100, "_GroupedLinear")
    kernel(1, 1, 10, 200, 50, "nvjet_tst_128x256_64x4")  # grouped GEMM: GEMM under GroupedLinear
    op(1, 100, 50, "aten::mm")
    kernel(2, 1, 110, 260, 40, "sm90_xmma_gemm_bf16")  # dense
    kernel(3, 1, 120, 400, 30, "ncclDevKernel_AllReduce")  # communication; 250-260 and 300-400 idle
    op(2, 130, 20, "autograd::engine::evaluate_function: FusedAttnFuncBackward")
    kernel(4, 2, 135, 430, 20, "cudnn_generated_fort_native_sdpa")
    kernel(5, 1, 140, 450, 10, "triton_poi_fused_mul_0")
    return {"traceEvents": ev}


#: microseconds x 1e-6 in float64: a few roundings of 2^-53 each; 1e-12 leaves a wide margin
REL = 1e-12


def test_kernels_are_classed_by_name_and_launching_operator():
    got = {r["class"]: r["seconds_per_step"] for r in profile_step.summarise_trace(_trace(), steps=1)["classes"]}
    assert got["grouped expert GEMM"] == pytest.approx(50e-6, rel=REL)
    assert got["dense GEMM"] == pytest.approx(40e-6, rel=REL)
    assert got["communication"] == pytest.approx(30e-6, rel=REL)
    assert got["attention"] == pytest.approx(20e-6, rel=REL)
    assert got["norms and elementwise"] == pytest.approx(10e-6, rel=REL)


def test_idle_is_the_span_without_any_kernel():
    out = profile_step.summarise_trace(_trace(), steps=1)
    # kernels cover 200-250, 260-300 and 400-460 of the span 200-460: 150 busy, 110 idle (microseconds)
    assert out["busy_seconds_per_step"] == pytest.approx(150e-6, rel=REL)
    assert out["idle_seconds_per_step"] == pytest.approx(110e-6, rel=REL)


def test_launch_sites_name_the_operators_behind_each_kernel():
    trace = _trace()
    for e in trace["traceEvents"]:  # operator shapes as the profiler records them with record_shapes
        if e.get("name") == "aten::mm":
            e["args"] = {"Input Dims": [[4096, 8192], [8192, 1024]]}
    rows = {r["class"]: r for r in profile_step.summarise_trace(trace, steps=1)["classes"]}
    (site,) = rows["dense GEMM"]["top_sites"]
    assert site["kernel"] == "sm90_xmma_gemm_bf16"
    assert site["operators"] == "aten::mm[[4096,8192],[8192,1024]]"
    assert site["seconds_per_step"] == pytest.approx(40e-6, rel=REL)
    (grouped,) = rows["grouped expert GEMM"]["top_sites"]
    assert grouped["operators"] == "_GroupedLinear"


def test_idle_gaps_are_split_by_length_and_name_the_host_call_in_them():
    trace = _trace()
    # the host waits on the GPU between the dense GEMM and the NCCL kernel (gap 300-400)
    trace["traceEvents"].append({"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 290, "dur": 105, "name": "aten::item"})
    trace["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 295, "dur": 100,
                                 "name": "cudaStreamSynchronize"})
    out = profile_step.summarise_trace(trace, steps=1)
    # gaps: 250-260 (10 us) and 300-400 (100 us); the bins are [0, 100), [100, 1000), [1000, inf)
    bins = {b["gap_us"]: b for b in out["idle_by_gap_length"]}
    assert bins["0-100"]["count_per_step"] == 1 and bins["0-100"]["seconds_per_step"] == pytest.approx(10e-6, rel=REL)
    assert bins["100-1000"]["count_per_step"] == 1
    assert bins["100-1000"]["seconds_per_step"] == pytest.approx(100e-6, rel=REL)
    assert bins["1000-inf"]["count_per_step"] == 0
    assert sum(b["seconds_per_step"] for b in bins.values()) == pytest.approx(out["idle_seconds_per_step"], rel=REL)
    first, second = out["longest_gaps"]
    assert first["seconds"] == pytest.approx(100e-6, rel=REL) and first["at_s"] == pytest.approx(100e-6, rel=REL)
    assert first["runtime_call"] == "cudaStreamSynchronize"
    assert first["runtime_call_share"] == pytest.approx(95 / 100, rel=REL)  # 300-395 of the gap 300-400
    assert first["operators"] == "aten::item"
    assert second["seconds"] == pytest.approx(10e-6, rel=REL) and second["runtime_call"] is None


def test_a_gap_after_a_blocking_call_names_the_call_that_drained_the_gpu():
    """The host blocks in a .cpu() until the GPU has run dry (the dense GEMM ends at 300), then
    spends 100 us in Python before the next launch: the gap 300-400 has no runtime call in it, and
    is named as drained by the copy; a short launch call near a gap start is not a blocking call."""
    trace = _trace()
    trace["traceEvents"].append({"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 150, "dur": 160, "name": "aten::_to_copy"})
    trace["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 160, "dur": 145,
                                 "name": "cudaMemcpyAsync"})  # returns at 305: 5 us into the gap
    out = profile_step.summarise_trace(trace, steps=1)
    first, second = out["longest_gaps"]
    assert first["drained_by"]["call"] == "cudaMemcpyAsync"
    assert first["drained_by"]["seconds"] == pytest.approx(145e-6, rel=REL)
    assert first["drained_by"]["operators"] == "aten::_to_copy"
    assert second["drained_by"] is None  # 250-260: only the 1 us launch calls end near it
    assert out["idle_after_blocking_calls"]["count_per_step"] == 1
    assert out["idle_after_blocking_calls"]["seconds_per_step"] == pytest.approx(100e-6, rel=REL)
    # without the blocking call nothing is attributed to one
    assert profile_step.summarise_trace(_trace(), steps=1)["idle_after_blocking_calls"]["count_per_step"] == 0
