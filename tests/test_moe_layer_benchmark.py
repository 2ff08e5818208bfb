"""``benchmarks.moe_layer --cpu-smoke``: every peer of the MoE layer benchmark runs, and its table and JSON say so."""

from __future__ import annotations

import json

import pytest

from tests.support import ON_GPU


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; the GPU runs the benchmark itself")
def test_moe_layer_benchmark_cpu_smoke(tmp_path):
    from benchmarks import moe_layer

    out = tmp_path / "moe_layer.md"
    moe_layer.main(["--cpu-smoke", "--routing", "uniform", "--micro-batches", "1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == set(moe_layer.PEERS)
    assert "not run" in rows["sonicmoe bf16"]["note"]
    # Against the bf16 peer on the same input: FP8 within its usual ~24 dB, torchtitan's bf16 flow far closer.
    for peer, floor in (("fp8 unfused", 20), ("fp8 fused", 20), ("torchtitan-style bf16", 35)):
        for key in ("out", "dx", "dw"):
            assert rows[peer][f"sqnr_{key}_db"] > floor, (peer, key)
    assert rows["fp8 fused"]["saved_gib"] < rows["fp8 unfused"]["saved_gib"]
    # Kept between optimizer steps, apart from what autograd saves: each expert weight's two FP8
    # layouts (one byte per element each) and their float32 scales; nothing without kept forms.
    c = moe_layer.CPU_SMOKE.layer
    elements = 3 * c.experts * c.dim * c.hidden
    kept = rows["fp8 fused"]["kept_fp8_weights_gib"] * 2**30
    assert 2 * elements < kept < 2 * elements + 4 * 4 * c.experts * (2 * c.hidden + c.dim)
    for peer in ("bf16", "fp8 fused, weights each pass", "torchtitan-style bf16"):
        assert rows[peer]["kept_fp8_weights_gib"] == 0, peer
    # Quantized at every pass, the dgrad layout is saved for backward instead of kept.
    assert rows["fp8 fused, weights each pass"]["saved_gib"] > rows["fp8 fused"]["saved_gib"]
    table = out.read_text()
    assert "| cpu-smoke | uniform | fp8 fused |" in table and "(reference)" in table
