"""Bandwidth of the FP8 quantization kernels against the device's copy bandwidth.

    python -m benchmarks.quant [--quick] [--recipe rowwise|blockwise|all] [--kernels NAME ...] [--out benchmarks/results/quant_h200.md]

Bytes counted per call: the input read once plus the outputs (fp8 data and fp32
scales) written once. ``% copy`` compares with a large device-to-device copy
timed in the same run. ``reads`` is how many times the call's kernels read the
input (a per-column scale over a whole expert or token group needs an amax pass
before the cast pass), and ``% copy, all reads`` counts every read: how close a
kernel runs to the bandwidth its passes need (the column-strip kernel's second
read comes from L2 for small groups, so it can pass 100%).
``experts_two_launches`` is ``quantize_rowwise_expert_weights``
followed by ``quantize_rowwise_expert_weights_transposed``: the baseline that
``quantize_rowwise_expert_weights_both_layouts`` has to beat;
``quantize_rowwise_expert_weights_and_transpose`` is what replaces it when the
recipe folds dgrad's weight scales into ``grad_out``. The grouped blockwise outputs are
in block space, ``(K, R * 128)`` fp8 and ``(R, K)`` scales with ``R = ceil(M/128) + G``,
written in full (zeros included), so those bytes are counted. The rowwise recipe
needs each activation both rowwise and per (group, column) in the padded token
layout: ``quantize_rowwise_rows + quantize_rowwise_cols_grouped (A=128), two calls`` is the two launchers in
turn, ``quantize_rowwise_rows_and_cols_grouped (A=128)`` the fused pair that replaces them
(for ``grad_out``, and for ``x`` without ``Fp8Recipe.fold_wgrad_input_scales``);
``quantize_rowwise_rows_and_transpose (A=128)`` is what the folded wgrad makes of ``x`` instead:
the rowwise form, then its FP8 bytes copied into the padded layout
(``transpose_to_token_groups``, also timed alone; the copy's read of the FP8 bytes
is not counted: the ideal writes both forms from one read).
``quantize_rowwise_cols_grouped`` writes the plain token layout (the column-strip kernel),
``quantize_rowwise_cols_grouped (A=128)`` the padded one (the two-pass kernels, rowwise output off).
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from autotune_cache import library_versions
from benchmarks.common import bench_kernel_us, bench_us, copy_bandwidth_gbs, offsets, routed_group_sizes

from kernels_helion import (
    quantize_blockwise_rows,
    quantize_blockwise_cols,
    quantize_blockwise_cols_grouped,
    quantize_blockwise_rows_and_cols,
    quantize_blockwise_rows_and_cols_grouped,
    quantize_blockwise_weights,
    quantize_blockwise_weights_both_layouts,
    quantize_blockwise_weights_transposed,
    quantize_rowwise_expert_weights,
    quantize_rowwise_expert_weights_and_transpose,
    quantize_rowwise_expert_weights_both_layouts,
    quantize_rowwise_expert_weights_transposed,
    quantize_rowwise_cols_grouped,
    quantize_rowwise_wgrad_operands,
    quantize_rowwise_cols_grouped_from_transposed,
    quantize_rowwise_rows,
    quantize_rowwise_rows_and_cols_grouped,
    transpose_fp8,
    transpose_to_token_groups,
)

BF16 = torch.bfloat16
# The blockwise recipe's block (DeepSeek-V3): 1x128, 128x1 and 128x128 scales.
BLOCK = 128


class Case(NamedTuple):
    """One benchmarked call."""

    kernel: str
    shape: str
    call: Callable[[], object]
    counted_bytes: int  # input read once, outputs written once
    reads: int = 1  # how many times the call's kernels read the input
    input_bytes: int = 0  # bytes of one read of the input (needed when reads > 1)


RECIPES = ("rowwise", "blockwise", "all")


def _weight_shapes(quick: bool) -> list[tuple[int, int, int]]:
    # The last four: the fine-grained experts' weights, Qwen3-30B-A3B's and DeepSeek-V3's w1 (as w3) and w2.
    return [(16, 8192, 5120), (8, 2048, 7168)] if quick else [
        (1, 8192, 5120), (16, 8192, 5120), (128, 8192, 5120), (8, 2048, 7168), (32, 2048, 7168),
        (128, 768, 2048), (128, 2048, 768), (256, 2048, 7168), (256, 7168, 2048),
    ]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rowwise_cases(quick: bool) -> list[Case]:
    """Every benchmarked rowwise-recipe call (see ``Case``)."""
    out: list[Case] = []
    for m in (16384,) if quick else (16384, 32768, 65536):
        for k in (5120, 7168):
            x = torch.randn(m, k, dtype=BF16, device="cuda")
            out.append(
                Case("quantize_rowwise_rows", f"{m}x{k}", lambda x=x: quantize_rowwise_rows(x), 3 * m * k + 4 * m)
            )
    for e, n, k in _weight_shapes(quick):
        w = torch.randn(e, n, k, dtype=BF16, device="cuda")
        one = 3 * e * n * k
        read = 2 * e * n * k
        name = f"{e}x{n}x{k}"
        out += [
            Case("quantize_rowwise_expert_weights", name, lambda w=w: quantize_rowwise_expert_weights(w), one + 4 * e * n),
            Case("quantize_rowwise_expert_weights_transposed", name,
                 lambda w=w: quantize_rowwise_expert_weights_transposed(w), one + 4 * e * k, 2, read),
            Case("quantize_rowwise_expert_weights_both_layouts", name,
                 lambda w=w: quantize_rowwise_expert_weights_both_layouts(w), 4 * e * n * k + 4 * e * (n + k), 2, read),
            # The folded dgrad's weight: the forward layout (one read of w), then its bytes copied
            # transposed (one more byte read per weight, not counted: the ideal writes both from one read).
            Case("quantize_rowwise_expert_weights_and_transpose", name,
                 lambda w=w: quantize_rowwise_expert_weights_and_transpose(w), 4 * e * n * k + 4 * e * n),
            Case("transpose_fp8", name, lambda q=quantize_rowwise_expert_weights(w)[0]: transpose_fp8(q), 2 * e * n * k),
            Case(
                "experts_two_launches",
                name,
                lambda w=w: (quantize_rowwise_expert_weights(w), quantize_rowwise_expert_weights_transposed(w)),
                4 * e * n * k + 4 * e * (n + k),
                3,
                read,
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
            read = 2 * m * k
            out += [
                Case("quantize_rowwise_cols_grouped", name,
                     lambda x=x, o=offs: quantize_rowwise_cols_grouped(x, o), one, 2, read),
                # The padded layout the recipes use (two-pass kernels; padding not counted as bytes).
                Case(
                    "quantize_rowwise_cols_grouped (A=128)",
                    name,
                    lambda x=x, o=offs: quantize_rowwise_cols_grouped(x, o, group_alignment=128),
                    one,
                    2,
                    read,
                ),
                Case("quantize_rowwise_cols_grouped_from_transposed", name,
                     lambda xt=xt, o=offs: quantize_rowwise_cols_grouped_from_transposed(xt, o), one, 2, read),
                Case(
                    "quantize_rowwise_wgrad_operands (grad_out = x's shape)",
                    name,
                    lambda x=x, o=offs: quantize_rowwise_wgrad_operands(x, x, o),
                    2 * one,
                    2,
                    2 * read,
                ),
                # What the recipe needs of each activation: both forms, wgrad's in the padded layout.
                Case(
                    "quantize_rowwise_rows + quantize_rowwise_cols_grouped (A=128), two calls",
                    name,
                    lambda x=x, o=offs: (quantize_rowwise_rows(x), quantize_rowwise_cols_grouped(x, o, group_alignment=128)),
                    one + m * k + 4 * m,
                    3,
                    read,
                ),
                Case(
                    "quantize_rowwise_rows_and_cols_grouped (A=128)",
                    name,
                    lambda x=x, o=offs: quantize_rowwise_rows_and_cols_grouped(x, o),
                    one + m * k + 4 * m,
                    2,
                    read,
                ),
                Case(
                    "quantize_rowwise_rows_and_transpose (A=128)",
                    name,
                    lambda x=x, o=offs: transpose_to_token_groups(quantize_rowwise_rows(x)[0], o),
                    4 * m * k + 4 * m,
                ),
                Case(
                    "transpose_to_token_groups (A=128)",
                    name,
                    lambda q=quantize_rowwise_rows(x)[0], o=offs: transpose_to_token_groups(q, o),
                    2 * m * k,
                ),
            ]
    return out


def blockwise_cases(quick: bool) -> list[Case]:
    """Every benchmarked blockwise-recipe call (see ``Case``)."""
    out: list[Case] = []
    for m in (16384,) if quick else (16384, 32768, 65536):
        for k in (5120, 7168):
            x = torch.randn(m, k, dtype=BF16, device="cuda")
            rows = m * k + 4 * m * _cdiv(k, BLOCK)  # fp8 (M, K) and 1x128 scales
            cols = m * k + 4 * _cdiv(m, BLOCK) * k  # fp8 (K, M) and 128x1 scales
            name = f"{m}x{k}"
            read = 2 * m * k
            out += [
                Case("quantize_blockwise_rows", name, lambda x=x: quantize_blockwise_rows(x), read + rows),
                Case("quantize_blockwise_cols", name, lambda x=x: quantize_blockwise_cols(x),
                     read + cols),
                Case("quantize_blockwise_rows_and_cols", name, lambda x=x: quantize_blockwise_rows_and_cols(x),
                     read + rows + cols, 2, read),
            ]
    # Qwen3-like (K = 2048) besides the large models.
    token_shapes = [(32768, 2048), (32768, 5120)] if quick else [
        (m, k) for m in (16384, 32768, 65536) for k in (2048, 5120, 7168)
    ]
    group_kinds = [(8, "uniform"), (32, "skewed")] if quick else [
        (g, kind) for g in (8, 32) for kind in ("uniform", "skewed")
    ]
    for m, k in token_shapes:
        x = torch.randn(m, k, dtype=BF16, device="cuda")
        for groups, kind in group_kinds:
            offs = offsets(routed_group_sizes(m, groups, kind, align=1))
            slots = _cdiv(m, BLOCK) + groups
            block_space = slots * BLOCK * k + 4 * slots * k  # fp8 (K, R * 128) and scales (R, K)
            rows = m * k + 4 * m * _cdiv(k, BLOCK)
            name = f"{m}x{k} G={groups} {kind}"
            out += [
                Case(
                    "quantize_blockwise_cols_grouped",
                    name,
                    lambda x=x, o=offs: quantize_blockwise_cols_grouped(x, o),
                    2 * m * k + block_space,
                ),
                Case(
                    "quantize_blockwise_rows_and_cols_grouped",
                    name,
                    lambda x=x, o=offs: quantize_blockwise_rows_and_cols_grouped(x, o),
                    2 * m * k + rows + block_space,
                    2,
                    2 * m * k,
                ),
            ]
    for e, n, k in _weight_shapes(quick):
        w = torch.randn(e, n, k, dtype=BF16, device="cuda")
        one = e * n * k + 4 * e * _cdiv(n, BLOCK) * _cdiv(k, BLOCK)  # one layout: fp8 and 128x128 scales
        name = f"{e}x{n}x{k}"
        read = 2 * e * n * k
        out += [
            Case("quantize_blockwise_weights", name, lambda w=w: quantize_blockwise_weights(w), read + one),
            Case("quantize_blockwise_weights_transposed", name, lambda w=w: quantize_blockwise_weights_transposed(w),
                 read + one),
            Case("quantize_blockwise_weights_both_layouts", name,
                 lambda w=w: quantize_blockwise_weights_both_layouts(w), read + 2 * one),
        ]
    return out


def cases(quick: bool, recipe: str = "all") -> list[Case]:
    """Every benchmarked call of ``recipe`` (or all; see ``Case``)."""
    out: list[Case] = []
    if recipe in ("rowwise", "all"):
        out += rowwise_cases(quick)
    if recipe in ("blockwise", "all"):
        out += blockwise_cases(quick)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short subset of the shapes")
    parser.add_argument("--recipe", choices=RECIPES, default="all", help="which recipe's kernels (default: all)")
    parser.add_argument("--kernels", nargs="*", help="time only the cases of these kernel names (default: all)")
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
        "Bytes counted: input read once + fp8 outputs and fp32 scales written once. Kernel time: CUDA-graph "
        "replay from a cold L2, no host overhead (`benchmarks.common.bench_kernel_us`, median); eager: one "
        "eager call (do_bench median), which measures the host side where that is longer than the kernels.",
        "",
        "| kernel | shape | kernel time (us) | GB/s | % copy | reads | % copy, all reads | eager (us) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = list(header)
    print("\n".join(header), flush=True)
    for case in cases(args.quick, args.recipe):
        if args.kernels and case.kernel not in args.kernels:
            continue
        if case.reads > 1 and case.input_bytes <= 0:
            raise ValueError(f"{case.kernel}: a case that reads its input {case.reads} times needs input_bytes")
        us = bench_kernel_us(case.call)
        gbs = case.counted_bytes / us / 1e3
        all_reads_gbs = (case.counted_bytes + (case.reads - 1) * case.input_bytes) / us / 1e3
        eager_us = bench_us(case.call)
        lines.append(
            f"| {case.kernel} | {case.shape} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {case.reads} "
            f"| {100 * all_reads_gbs / copy_gbs:.0f}% | {eager_us:.1f} |"
        )
        print(lines[-1], flush=True)
        if args.out is not None:  # rewritten after each row, so a cut-short run keeps its rows
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
