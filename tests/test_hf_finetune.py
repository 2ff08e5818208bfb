"""``benchmarks.hf_finetune`` at tiny widths: the transformers bf16 model learns; FP8 and our bf16 layer track it."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import hf_finetune  # noqa: E402  (needs transformers)

TINY = ["--size", "tiny", "--tokens", "128", "--seq-len", "64"]


def test_bf16_loss_falls_and_report_is_written(tmp_path):
    out = tmp_path / "hf_finetune.md"
    hf_finetune.main([*TINY, "--variants", "bf16", "--steps", "30", "--out", str(out), "--plot", str(tmp_path / "loss.png")])
    data = json.loads(out.with_suffix(".json").read_text())
    curve = data["losses"]["bf16"]
    assert len(curve) == 30 and all(math.isfinite(x) for x in curve)
    # From about ln(256) = 5.5 towards ln(4) = 1.4: after 30 steps the loss has clearly fallen.
    assert statistics.fmean(curve[-5:]) < statistics.fmean(curve[:5]) - 0.5
    report = out.read_text()
    assert "transformers bf16 (grouped_mm)" in report and "command: `python -m benchmarks.hf_finetune" in report
    assert data["settings"]["steps"] == 30 and data["summary"]["bf16"]["final_loss"] == curve[-1]


def test_fp8_and_our_bf16_layer_track_transformers_bf16(tmp_path):
    out = tmp_path / "hf_finetune.md"
    hf_finetune.main([*TINY, "--steps", "3", "--variants", "bf16", "ops_bf16", "fp8", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    bf16, ours, fp8 = (data["losses"][k] for k in ("bf16", "ops_bf16", "fp8"))
    assert len(fp8) == 3 and all(math.isfinite(x) for x in fp8 + ours)
    # The same initial weights and batch: the first losses differ only by rounding (FP8's, or
    # the combine's float32 sum in our layer).
    assert abs(fp8[0] - bf16[0]) / bf16[0] < 0.02
    assert abs(ours[0] - bf16[0]) / bf16[0] < 1e-3
    assert "fp8 (ops.convert_to_fp8)" in out.read_text()


def test_fp8_conversion_counts_modules():
    settings = hf_finetune.RunSettings("qwen3_moe", "tiny", 1, 64, 64, 1, 1e-2, 0, "sdpa")
    base = hf_finetune.build_model(settings, torch.device("cpu"), torch.bfloat16)
    assert hf_finetune.count_fp8_modules(base) == 0
    fp8 = hf_finetune.build_fp8(base, hf_finetune.ops.Fp8Recipe())
    assert hf_finetune.count_fp8_modules(fp8) == 1  # one MoE layer's experts
    assert hf_finetune.count_fp8_modules(base) == 0
    with pytest.raises(hf_finetune.NothingConverted, match="converted no module"):
        hf_finetune.build_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16)), hf_finetune.ops.Fp8Recipe())
