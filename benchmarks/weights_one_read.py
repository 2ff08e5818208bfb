"""Both FP8 forms of an expert weight from one launch, against quantize then ``transpose_fp8``.

    python -m benchmarks.weights_one_read [--out FILE]

``quantize_rowwise_expert_weights_and_transpose`` (one launch: each block of rows read from DRAM
once, its amaxes, then a cast of the same tiles stored as is and transposed) at each config of its
tuning space, against the two launches it replaces (``quantize_rowwise_expert_weights`` then
``transpose_fp8``), at the MoE layer benchmark's expert weights. Every output is checked bitwise
against the two launches'. Kernel time from CUDA-graph replays with a cold L2; "% of copy" counts the
4 bytes a weight must move (2 read, 1 + 1 written) at the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kernels_helion  # noqa: F401  (before helion: the torch compatibility layer)
import torch

from autotune_cache import forced_config
from autotune_cache.registry import tunable_kernels
from autotune_cache.timing import bench_kernel_us
from benchmarks.common import copy_bandwidth_gbs, environment_header, markdown_table
from kernels_helion.quantize_rowwise_weights import (
    quantize_rowwise_expert_weights,
    quantize_rowwise_expert_weights_and_transpose,
)
from kernels_helion.transpose_fp8 import transpose_fp8
from kernels_helion.tuning import LAYER_WEIGHT_SHAPES

NAME = "quantize_rowwise_expert_weights_and_transpose"


def two_launches(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scales = quantize_rowwise_expert_weights(w)
    return q, scales, transpose_fp8(q)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="num_warps values of the sweep")
    parser.add_argument("--block-n", type=int, nargs="+", default=None, help="rows per program to sweep (default: all)")
    parser.add_argument("--shapes", type=int, nargs="+", default=None, help="indexes into LAYER_WEIGHT_SHAPES")
    args = parser.parse_args()
    configs = [
        c for c in tunable_kernels()[NAME].space("sm90")
        if c.config["num_warps"] in args.warps and (args.block_n is None or c.config["block_sizes"][0] in args.block_n)
    ]
    shapes = LAYER_WEIGHT_SHAPES if args.shapes is None else [LAYER_WEIGHT_SHAPES[i] for i in args.shapes]
    copy = copy_bandwidth_gbs()
    rows, data = [], []
    for shape in shapes:
        e, n, k = shape["E"], shape["N"], shape["K"]
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        gbytes = 4 * w.numel() / 1e9
        ref = two_launches(w)
        base = bench_kernel_us(lambda w=w: two_launches(w))
        best = None
        for cfg in configs:
            with forced_config(NAME, cfg):
                try:
                    ok = same(quantize_rowwise_expert_weights_and_transpose(w), ref)
                except Exception as exc:  # noqa: BLE001  (a config that does not compile is skipped)
                    data.append({"shape": shape, "config": cfg.config, "error": repr(exc)[:200]})
                    continue
                us = bench_kernel_us(lambda w=w: quantize_rowwise_expert_weights_and_transpose(w))
            data.append({"shape": shape, "config": cfg.config, "us": us, "bitwise": ok, "two_launches_us": base})
            if ok and (best is None or us < best[0]):
                best = (us, cfg)
            print(shape, cfg.config["block_sizes"], cfg.config["num_warps"], f"{us:.1f} us", ok, flush=True)

        def pct(us: float) -> str:
            return f"{100 * gbytes / (us * 1e-6) / copy:.0f}%"

        rows.append([
            f"{e}x{n}x{k}", f"{base:.1f}", pct(base),
            f"{best[0]:.1f}" if best else "-", pct(best[0]) if best else "-",
            f"{base / best[0]:.3f}" if best else "-",
            f"{best[1].config['block_sizes'][:2]}, {best[1].config['num_warps']} warps" if best else "-",
        ])
        print(rows[-1], flush=True)
        del w, ref
        torch.cuda.empty_cache()
    report = (
        environment_header("Both FP8 weight forms from one launch")
        + "\nCommand: `python -m benchmarks.weights_one_read`. Copy bandwidth "
        + f"{copy:.0f} GB/s; % of copy counts 4 bytes a weight.\n\n"
        + markdown_table(
            ["weight E x N x K", "two launches us", "% of copy", "one launch us (best config)", "% of copy", "speed-up", "config"],
            rows,
        )
    )
    print(report)
    if args.out:
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
