"""``benchmarks.layer_floors``: kernel tables read per step, pass bytes that scale as the shapes do,
and the GEMM rate a target needs, on synthetic tables and results."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import layer_floors
from benchmarks.common import sm_clock_mhz
from benchmarks.moe_layer import CONFIGS, LayerShape
from benchmarks.moe_parallel import LayerConfig
from ops.wgrad_precision import BF16_WGRAD_MAX_ROWS_PER_GROUP


def _row(name: str, cuda_total: str, calls: int) -> str:
    # torch.profiler's table: name, self CPU %, self CPU, CPU total %, CPU total, CPU avg,
    # self CUDA, self CUDA %, CUDA total, CUDA avg, calls.
    return (
        f"{name:>60}  0.00%  0.000us  0.00%  0.000us  0.000us  {cuda_total}  10.00%  {cuda_total}  1.000us  {calls}  "
    )


def _table(sections: dict[str, list[str]], wall: dict[str, str]) -> str:
    return "\n\n".join(
        f"## {title}\n\n" + (f"Wall time of the 3 profiled steps: {wall[title]} (CUDA events around them); "
                              "SM clock after them: 1650 MHz\n\n"
                              if title in wall else "")
        + "\n".join(["-" * 40, *rows, "-" * 40])
        for title, rows in sections.items()
    )


TABLE = _table({
    "bf16 (3 steps of 1 micro-batch)": [_row("_ZN7cutlass13device_kernel", "30.000ms", 9)],
    "fp8 fused (3 steps of 1 micro-batch)": [
        _row("_helion_grouped_mm_2d3d_kernel", "6.000ms", 9),
        _row("_helion_grouped_mm_swiglu_kernel", "3.000ms", 3),
        _row("_ZN7cutlass13device_kernelIN2at4cuda", "1.500ms", 3),
        _row("_helion_moe_combine_kernel", "900.000us", 6),
        _row("Memset (Device)", "30.000us", 15),
        "Self CUDA time total: 12.000ms",
    ],
    "fp8 fused (1 step of 4 micro-batches)": [_row("_helion_grouped_mm_2d3d_kernel", "99.000ms", 12)],
}, wall={"fp8 fused (3 steps of 1 micro-batch)": "13.500ms"})


def test_kernel_times_reads_its_section_per_step():
    times = layer_floors.kernel_times(TABLE)
    assert times == pytest.approx({
        "_helion_grouped_mm_2d3d_kernel": 2.0,
        "_helion_grouped_mm_swiglu_kernel": 1.0,
        "_ZN7cutlass13device_kernelIN2at4cuda": 0.5,
        "_helion_moe_combine_kernel": 0.3,
        "Memset (Device)": 0.01,
    })
    assert layer_floors.kernel_times(TABLE, "bf16") == pytest.approx({"_ZN7cutlass13device_kernel": 10.0})
    with pytest.raises(ValueError, match="no section 'sonicmoe bf16'"):
        layer_floors.kernel_times(TABLE, "sonicmoe bf16")
    # Every kernel's time (listed or not) and the profiled steps' wall time, per step; bf16's has neither line.
    assert layer_floors.step_totals(TABLE) == pytest.approx((4.0, 4.5))
    assert layer_floors.step_totals(TABLE, "bf16") == (None, None)


def test_activation_passes_scale_with_the_tokens_and_the_weights_do_not():
    layer = LayerConfig("test", 256, 128, 8, 2)
    small, large = LayerShape(layer, 4096), LayerShape(layer, 8192)  # 1024 and 2048 rows an expert: FP8 wgrads
    assert layer_floors.fp8_wgrad(small) and layer_floors.fp8_wgrad(large)
    a, b = layer_floors.memory_passes(small), layer_floors.memory_passes(large)
    assert a.keys() == b.keys()
    weights = "weights, quantized and copied transposed"
    assert a[weights] == b[weights] == 5 * 3 * 8 * 128 * 256
    for name in a.keys() - {weights}:
        assert b[name] == 2 * a[name], name
    assert layer_floors.expert_gemm_flops(large) == 2 * layer_floors.expert_gemm_flops(small)


def test_the_wgrad_precision_follows_the_auto_threshold():
    layer = LayerConfig("test", 256, 128, 8, 2)
    rows_per_expert = BF16_WGRAD_MAX_ROWS_PER_GROUP
    at = LayerShape(layer, rows_per_expert * layer.experts // layer.top_k)
    below = LayerShape(layer, at.tokens - 1)
    assert layer_floors.fp8_wgrad(at) and not layer_floors.fp8_wgrad(below)
    # Without an FP8 wgrad no token-group copies and no two-form quantization are counted.
    assert "x gathered in bf16" in layer_floors.memory_passes(below)
    assert not any("two forms" in name or "token-group" in name for name in layer_floors.memory_passes(below))


def test_the_needed_gemm_rate_leaves_the_floor_to_the_other_passes(monkeypatch):
    shape = CONFIGS["qwen3-32k"]
    flops = layer_floors.expert_gemm_flops(shape)
    floor_ms = sum(layer_floors.memory_passes(shape).values()) / layer_floors.COPY_BANDWIDTH * 1e3
    monkeypatch.setattr(layer_floors, "TARGETS", {"qwen3-32k": (("bf16", 2.0), ("slow peer", 1.0), ("fast", 100.0))})
    results = [{"rows": [
        {"config": "qwen3-32k", "routing": "uniform", "peer": "fp8 fused", "ms": 13.0},
        {"config": "qwen3-32k", "routing": "uniform", "peer": "bf16", "ms": 20.0},
        {"config": "qwen3-32k", "routing": "skewed", "peer": "bf16", "ms": 1.0},  # other routing: not read
        {"config": "qwen3-32k", "routing": "uniform", "peer": "slow peer", "ms": 40.0},
        {"config": "qwen3-32k", "routing": "uniform", "peer": "fast", "ms": 40.0},
    ]}]
    rows = {r["target"]: r for r in layer_floors.floor_rows({"qwen3-32k": TABLE}, layer_floors.step_times(results))
            if r["config"] == "qwen3-32k"}
    two = rows["2.0x bf16"]
    assert two["fp8_ms"] == 13.0 and two["target_ms"] == pytest.approx(10.0)
    assert two["needed_gemm_tflops"] == pytest.approx(flops / (10.0 - floor_ms) / 1e9)
    # A slower peer asks for less; a target under the floor cannot be met by any GEMM.
    assert rows["1.0x slow peer"]["needed_gemm_tflops"] < two["needed_gemm_tflops"]
    assert math.isinf(rows["100.0x fast"]["needed_gemm_tflops"])
    # The expert GEMMs are the grouped GEMMs and CUTLASS's: 2 + 1 + 0.5 ms of the section's 4.0 (its
    # "Self CUDA time total": unlisted kernels too); its profiled steps took 4.5 ms each.
    assert two["gemm_ms"] == pytest.approx(3.5) and two["other_ms"] == pytest.approx(0.5)
    assert two["profiled_wall_ms"] == pytest.approx(4.5)
    assert two["gemm_tflops"] == pytest.approx(flops / 3.5 / 1e9)


def test_command_line_writes_table_and_json(tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text(TABLE)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        {"config": "dsv3-32", "routing": "uniform", "peer": "fp8 fused", "ms": 80.0},
        {"config": "dsv3-32", "routing": "uniform", "peer": "bf16", "ms": 128.0},
    ]}))
    out = tmp_path / "floors.md"
    layer_floors.main(["--profiles", f"dsv3-32={profile}", "--results", str(results), "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = [r for r in data["rows"] if r["config"] == "dsv3-32"]
    assert row["target"] == "1.6x bf16" and row["target_ms"] == pytest.approx(80.0)
    assert "| dsv3-32 | FP8 | 80.00 | 1.6x bf16 | 80.00 | 3.50 (" in out.read_text()
    with pytest.raises(SystemExit, match="CONFIG=FILE"):
        layer_floors.main(["--profiles", "nope=x"])


def test_the_sm_clock_is_read_or_unknown():
    """The clock line of a kernel table: MHz where NVML answers, else ``None``, never an exception."""
    clock = sm_clock_mhz()
    assert clock is None or 100 < clock < 10_000
    if not torch.cuda.is_available():
        assert clock is None
