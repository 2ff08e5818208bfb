"""MXFP8 kernels on the GPU: quantization, scale layouts and padding against copy bandwidth; the emulated GEMMs.

    python -m benchmarks.mx [--quick] [--skip-gemm] [--out benchmarks/results/mx_h200.md]

Bandwidth part: bytes counted per call are the input read once plus the outputs
written once (fp8 data, one e8m0 byte per 32 elements, blocked scales or padded
rows as allocated); ``% copy`` compares with a large device-to-device copy timed
in the same run (the target is >= 85%). For the scale-layout kernels, which move
a few MB, ``% same-size copy`` compares with a copy of the kernel's own bytes
timed the same way: what a kernel of that size can reach at best (such a copy is
bound by its launch and DRAM latency, not by bandwidth). Token groups: odd sizes
around M / G (the MX kernels take any sizes), 100 tokens past the last group.

GEMM part: the emulated MXFP8 grouped GEMMs (one FP8 tensor-core dot per 32-wide
block, scaled in fp32: what Hopper can do without MX tensor cores) against
bf16 ``torch._grouped_mm``, forward (2D x 3D) and wgrad (2D x 2D), in TFLOP/s
(2 * tokens * N * K / median time). Emulation is not expected to beat bf16.
The recipe end to end: ``python -m benchmarks.grouped_linear --recipe mxfp8``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    bench_kernel_us,
    bench_us,
    copy_bandwidth_gbs,
    emit_report,
    environment_header,
    markdown_table,
    offsets,
    routed_group_sizes,
)
from kernels_helion import (
    grouped_mm_2d3d_mx,
    grouped_mm_wgrad_mx,
    pad_token_groups,
    quantize_mx_rows,
    quantize_mx_cols,
    quantize_mx_cols_grouped,
    quantize_mx_rows_and_cols_grouped,
    quantize_mx_expert_weights,
    to_blocked_scales,
    to_blocked_scales_grouped,
    to_blocked_scales_k_groups,
    to_blocked_scales_per_expert,
    unpad_token_groups,
)

BF16 = torch.bfloat16
MX = 32
DEVICE = "cuda"

# Kernels moving fewer bytes are also compared with a copy of their own size.
SMALL_BYTES = 64 << 20

# (kernel, shape, call, bytes moved)
Case = tuple[str, str, Callable[[], object], int]

TOKEN_SHAPES = [(32768, 2048, 16), (32768, 5120, 8), (32768, 7168, 8), (65536, 7168, 32)]
WEIGHT_SHAPES = [(4, 8192, 5120), (8, 2048, 7168), (16, 1536, 2048)]
GEMM_SHAPES = [  # (name, M, N, K, G), as benchmarks.grouped_gemm
    ("Llama4", 32768, 8192, 5120, 4),
    ("DSV3-up", 32768, 2048, 7168, 8),
    ("DSV3-down", 32768, 7168, 2048, 8),
    ("Qwen3", 32768, 1536, 2048, 16),
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_cases(m: int, k: int, groups: int) -> list[Case]:
    """Activations / gradients ``(M, K)`` with ``groups`` token groups."""
    x = torch.randn(m, k, dtype=BF16, device=DEVICE)
    offs = offsets(routed_group_sizes(m - 100, groups, "unaligned"), DEVICE)
    name = f"{m}x{k} G={groups}"
    data = m * k
    row_scales = quantize_mx_rows(x)[1]
    _, col_scales, block_offs = quantize_mx_cols_grouped(x, offs)
    col_scales_t = col_scales.t()  # (features, blocks), as the wgrad's blocked layout reads it
    padded, padded_offs = pad_token_groups(x, offs, 32)
    grouped_blocked = (_cdiv(m, 128) + groups) * 128 * _cdiv(k // MX, 4) * 4
    k_groups_blocked = _cdiv(k, 128) * 128 * (_cdiv(col_scales.size(0), 4) * 4 + 4 * groups)
    return [
        ("quantize_mx_rows", name, lambda: quantize_mx_rows(x), 3 * data + row_scales.numel()),
        ("quantize_mx_cols (no groups)", name, lambda: quantize_mx_cols(x), 3 * data + row_scales.numel()),
        ("quantize_mx_cols_grouped", name, lambda: quantize_mx_cols_grouped(x, offs), 3 * data + col_scales.numel()),
        (
            "quantize_mx_rows_and_cols_grouped (rows + grouped cols, one read)",
            name,
            lambda: quantize_mx_rows_and_cols_grouped(x, offs),
            4 * data + row_scales.numel() + col_scales.numel(),
        ),
        ("pad_token_groups (to 32)", name, lambda: pad_token_groups(x, offs, 32), 2 * data + 2 * padded.numel()),
        ("unpad_token_groups", name, lambda: unpad_token_groups(padded, offs, padded_offs, m), 4 * data),
        (
            "to_blocked_scales_grouped (row scales)",
            name,
            lambda: to_blocked_scales_grouped(row_scales, offs),
            row_scales.numel() + grouped_blocked,
        ),
        (
            "to_blocked_scales_k_groups (grouped col scales)",
            name,
            lambda: to_blocked_scales_k_groups(col_scales_t, block_offs),
            col_scales.numel() + k_groups_blocked,
        ),
    ]


def weight_cases(e: int, n: int, k: int) -> list[Case]:
    """Expert weights ``(E, N, K)``, both layouts, and their scales' blocked layout."""
    w = torch.randn(e, n, k, dtype=BF16, device=DEVICE)
    name = f"{e}x{n}x{k}"
    data = e * n * k
    scales = quantize_mx_expert_weights(w)[1]
    blocked = e * _cdiv(n, 128) * 128 * _cdiv(k // MX, 4) * 4
    return [
        ("quantize_mx_expert_weights (along K)", name, lambda: quantize_mx_expert_weights(w), 3 * data + data // MX),
        (
            "quantize_mx_expert_weights (along N, transposed)",
            name,
            lambda: quantize_mx_expert_weights(w, transposed=True),
            3 * data + data // MX,
        ),
        ("to_blocked_scales_per_expert", name, lambda: to_blocked_scales_per_expert(scales), scales.numel() + blocked),
        (
            "to_blocked_scales (one matrix)",
            name,
            lambda: to_blocked_scales(scales.view(-1, scales.size(-1))),
            scales.numel() + blocked,
        ),
    ]


def same_size_copy_us(nbytes: int) -> float:
    """Kernel time of a device-to-device copy that reads and writes ``nbytes`` in all (as ``bench_kernel_us``)."""
    # bf16 elements: PyTorch's copy of 1-byte elements runs below the device's bandwidth.
    src = torch.randn(max(nbytes // 4, 1), dtype=BF16, device=DEVICE)
    dst = torch.empty_like(src)
    return bench_kernel_us(lambda: dst.copy_(src))


def bandwidth_table(quick: bool) -> str:
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    makers = [(token_cases, s) for s in (TOKEN_SHAPES[1:2] if quick else TOKEN_SHAPES)]
    makers += [(weight_cases, s) for s in (WEIGHT_SHAPES[1:2] if quick else WEIGHT_SHAPES)]
    for make_cases, shape in makers:
        # One shape's tensors at a time.
        for kernel, name, fn, nbytes in make_cases(*shape):
            us = bench_kernel_us(fn)
            gbs = nbytes / us / 1e3
            same_size = f"{100 * same_size_copy_us(nbytes) / us:.0f}%" if nbytes < SMALL_BYTES else "-"
            rows.append([kernel, name, us, gbs, f"{100 * gbs / copy_gbs:.0f}%", same_size, bench_us(fn)])
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return (
        f"Device copy bandwidth (2 GiB D2D copy, read + write): {copy_gbs:.0f} GB/s. Kernel time: CUDA-graph "
        "replay from a cold L2, no host overhead (`benchmarks.common.bench_kernel_us`); eager: one eager call "
        "(do_bench median), which includes the host side when that is longer than the kernels. % same-size copy "
        f"(kernels moving under {SMALL_BYTES >> 20} MiB): the kernel time of a device-to-device copy of the same "
        "bytes (read + write) over the kernel's.\n\n"
        + markdown_table(
            ["kernel", "shape", "kernel time (us)", "GB/s", "% copy", "% same-size copy", "eager (us)"], rows
        )
    )


def gemm_rows(name: str, m: int, n: int, k: int, g: int) -> list[list[object]]:
    """Forward and wgrad of one shape: emulated MXFP8 against bf16."""
    sizes = routed_group_sizes(m, g, "skewed")
    offs = offsets(sizes, DEVICE)
    flop = 2 * sum(sizes) * n * k
    x = torch.randn(m, k, dtype=BF16, device=DEVICE)
    w = torch.randn(g, n, k, dtype=BF16, device=DEVICE) * k**-0.5
    grad_out = torch.randn(m, n, dtype=BF16, device=DEVICE)
    a, sa = quantize_mx_rows(x)
    b, sb = quantize_mx_expert_weights(w)
    got, got_s, block_offs = quantize_mx_cols_grouped(grad_out, offs)
    xt, xt_s, _ = quantize_mx_cols_grouped(x, offs)
    # bf16 wgrad operands in the same token-contiguous layouts.
    got16, xt16 = grad_out.t().contiguous(), x.t().contiguous()
    roles = {
        "forward": (
            lambda: grouped_mm_2d3d_mx(a, sa, b, sb, offs),
            lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        ),
        "wgrad": (
            lambda: grouped_mm_wgrad_mx(got, got_s, xt, xt_s, offs, block_offs),
            lambda: torch._grouped_mm(got16, xt16.t(), offs=offs),
        ),
    }
    rows = []
    for role, (ours, bf16) in roles.items():
        ours_ms, bf16_ms = bench_us(ours) / 1e3, bench_us(bf16) / 1e3
        rows.append([
            f"{name} ({m},{n},{k},{g})", role, ours_ms, bf16_ms,
            flop / ours_ms / 1e9, flop / bf16_ms / 1e9, bf16_ms / ours_ms,
        ])
        print(rows[-1], flush=True)
    return rows


def gemm_table(quick: bool) -> str:
    rows = []
    for shape in GEMM_SHAPES[1:2] if quick else GEMM_SHAPES:
        rows += gemm_rows(*shape)
        torch.cuda.empty_cache()
    headers = ["shape (M,N,K,G)", "role", "MX emulated ms", "bf16 ms", "MX TFLOP/s", "bf16 TFLOP/s", "MX / bf16 speed"]
    return "Skewed (Dirichlet(1)) routing, sizes multiples of 16.\n\n" + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one token shape, one weight shape, one GEMM shape")
    parser.add_argument("--skip-gemm", action="store_true", help="bandwidth part only")
    parser.add_argument("--out", type=Path, help="write the markdown report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.mx needs a CUDA GPU")
    torch.manual_seed(0)
    report = environment_header("MXFP8 kernels") + "\n## Quantization, scale layouts, padding\n\n"
    report += bandwidth_table(args.quick)
    if not args.skip_gemm:
        report += "\n## Emulated MXFP8 grouped GEMMs vs bf16\n\n" + gemm_table(args.quick)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
