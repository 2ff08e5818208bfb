"""Bandwidth of the FP8 quantization kernels against the device's copy bandwidth.

    python -m benchmarks.quant [--quick] [--out benchmarks/results/quant_h200.md]

Bytes counted per call: the input read once plus the outputs (fp8 data and fp32
scales) written once. ``% copy`` compares with a large device-to-device copy
timed in the same run. ``experts_two_launches`` is ``quantize_expert_weights``
followed by ``quantize_expert_weights_transposed``: the baseline that
``quantize_expert_weights_dual`` has to beat.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from autotune_cache import library_versions
from benchmarks.common import bench_us, copy_bandwidth_gbs, offsets, routed_group_sizes

from kernels_helion import (
    quantize_expert_weights,
    quantize_expert_weights_dual,
    quantize_expert_weights_transposed,
    quantize_jagged_colwise,
    quantize_jagged_colwise_dual,
    quantize_jagged_rowwise,
    quantize_rowwise,
)

BF16 = torch.bfloat16


def cases(quick: bool) -> list[tuple[str, str, Callable[[], object], int]]:
    """(kernel, shape, call, bytes moved) for every benchmarked call."""
    out: list[tuple[str, str, Callable[[], object], int]] = []
    for m in (16384,) if quick else (16384, 32768, 65536):
        for k in (5120, 7168):
            x = torch.randn(m, k, dtype=BF16, device="cuda")
            out.append(("quantize_rowwise", f"{m}x{k}", lambda x=x: quantize_rowwise(x), 3 * m * k + 4 * m))
    weight_shapes = [(16, 8192, 5120), (8, 2048, 7168)] if quick else [
        (1, 8192, 5120), (16, 8192, 5120), (128, 8192, 5120), (8, 2048, 7168), (32, 2048, 7168)
    ]
    for e, n, k in weight_shapes:
        w = torch.randn(e, n, k, dtype=BF16, device="cuda")
        one = 3 * e * n * k
        name = f"{e}x{n}x{k}"
        out += [
            ("experts_rowwise", name, lambda w=w: quantize_expert_weights(w), one + 4 * e * n),
            ("experts_transposed", name, lambda w=w: quantize_expert_weights_transposed(w), one + 4 * e * k),
            ("experts_dual", name, lambda w=w: quantize_expert_weights_dual(w), 4 * e * n * k + 4 * e * (n + k)),
            (
                "experts_two_launches",
                name,
                lambda w=w: (quantize_expert_weights(w), quantize_expert_weights_transposed(w)),
                4 * e * n * k + 4 * e * (n + k),
            ),
        ]
    token_shapes = [(32768, 5120)] if quick else [(32768, 5120), (32768, 7168), (65536, 5120), (65536, 7168)]
    group_kinds = [(1, "uniform"), (16, "skewed"), (64, "uniform")] if quick else [
        (g, kind) for g in (1, 16, 64) for kind in ("uniform", "skewed") if not (g == 1 and kind == "skewed")
    ]
    for m, k in token_shapes:
        x = torch.randn(m, k, dtype=BF16, device="cuda")
        xt = x.t().contiguous()
        for groups, kind in group_kinds:
            offs = offsets(routed_group_sizes(m, groups, kind, align=1))
            name = f"{m}x{k} G={groups} {kind}"
            one = 3 * m * k + 4 * groups * k
            out += [
                ("jagged_colwise", name, lambda x=x, o=offs: quantize_jagged_colwise(x, o), one),
                ("jagged_rowwise", name, lambda xt=xt, o=offs: quantize_jagged_rowwise(xt, o), one),
                (
                    "jagged_colwise_dual (grad_out = x's shape)",
                    name,
                    lambda x=x, o=offs: quantize_jagged_colwise_dual(x, x, o),
                    2 * one,
                ),
            ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of the shapes")
    parser.add_argument("--out", type=Path, help="write the markdown table to this file")
    args = parser.parse_args()
    torch.manual_seed(0)

    copy_gbs = copy_bandwidth_gbs()
    header = [
        f"# FP8 quantization kernels: bandwidth ({datetime.date.today().isoformat()})",
        "",
        f"GPU: {torch.cuda.get_device_name()}; "
        + ", ".join(f"{name} {version}" for name, version in library_versions().items())
        + f". Device copy bandwidth (2 GiB D2D copy, read + write): {copy_gbs:.0f} GB/s. "
        "Bytes counted: input read once + fp8 outputs and fp32 scales written once. Times: medians.",
        "",
        "| kernel | shape | time (us) | GB/s | % copy |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines = list(header)
    print("\n".join(header), flush=True)
    for kernel, shape, fn, nbytes in cases(args.quick):
        us = bench_us(fn)
        gbs = nbytes / us / 1e3
        lines.append(f"| {kernel} | {shape} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")
        print(lines[-1], flush=True)
        if args.out is not None:  # rewritten after each row, so a cut-short run keeps its rows
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
