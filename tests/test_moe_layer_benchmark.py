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
    table = out.read_text()
    assert "| cpu-smoke | uniform | fp8 fused |" in table and "(reference)" in table
