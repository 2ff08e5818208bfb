"""Benchmark the FP8 grouped GEMMs against torch._scaled_grouped_mm (CUTLASS) and bf16 torch._grouped_mm.

Roles, for MoE shapes (M tokens, N, K, G experts):
    forward: x (M, K) @ W[g]^T, W (G, N, K)           -> (M, N)   grouped_mm_2d3d[_blockwise]
    dgrad:   grad_out (M, N) @ W[g], W^T (G, K, N)    -> (M, K)   grouped_mm_2d3d[_blockwise]
    wgrad:   grad_out^T (N, M) @ x (M, K) per group   -> (G, N, K) grouped_mm_wgrad[_blockwise]
``--recipe blockwise`` times our blockwise kernels (1x128 activation, 128x128
weight, per-group 128x1 wgrad scales: DeepSeek-V3) in place of the rowwise ones;
the torch peers stay rowwise FP8 and bf16 (PyTorch has no blockwise grouped GEMM).
Rowwise wgrad operands are in the padded token layout our quantizer writes for the
recipe (each group from a multiple of 128 token columns: no masked loads); a
``wgrad, plain layout`` row times ours on torch's layout. Routing: ``uniform``, ``skewed`` (Dirichlet(1), sizes multiples of 16 so that
torch's 2Dx2D kernel runs), ``unaligned`` (odd sizes; ours only, torch needs 16-aligned
groups). ``--fine-grained`` runs the fine-grained MoE shapes (Qwen3-30B-A3B, DeepSeek-V3:
128 and 256 experts, ``benchmarks.common.FINE_GRAINED_SHAPES``) in place of the default
set, routed ``uniform``, ``skewed`` and ``sparse`` (Dirichlet(0.3): some experts get no
tokens). Times are medians of triton.testing.do_bench, peers timed round-robin in
rotating order (``benchmarks.common.bench_peers_us``: the GPU's clock falls under
sustained load); TFLOP/s count 2*M*N*K over the routed tokens.

    python -m benchmarks.grouped_gemm [--recipe rowwise|blockwise] [--quick | --fine-grained] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math

import torch
import triton

from autotune_cache import library_versions
from benchmarks.common import (
    ALIGNED_ROUTINGS,
    FINE_GRAINED_SHAPES,
    bench_peers_us,
    bench_us,
    offsets,
    routed_group_sizes,
)
from kernels_helion import grouped_mm_2d3d, grouped_mm_2d3d_blockwise, grouped_mm_wgrad, grouped_mm_wgrad_blockwise
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count

FP8 = torch.float8_e4m3fn
RECIPES = ("rowwise", "blockwise")
BLOCK = 128
SHAPES = [  # (M, N, K, G)
    ("Llama4", 32768, 8192, 5120, 4),
    ("DSV3-up", 32768, 2048, 7168, 8),
    ("DSV3-down", 32768, 7168, 2048, 8),
    ("Qwen3", 32768, 1536, 2048, 16),
    ("G32", 65536, 2048, 7168, 32),
]


def fp8_rows(rows: int, cols: int, *lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = (torch.randn(*lead, rows, cols, device="cuda") * 100).clamp(-448, 448).to(FP8)
    scales = torch.rand(*lead, rows, device="cuda") * 1e-2 + 1e-3
    return data, scales


def random_scales(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, device="cuda") * 1e-2 + 1e-3


def act_block_scales(m: int, k: int) -> torch.Tensor:
    """1x128 scales ``(M, ceil(K/128))`` in ``quantize_blockwise_rows``'s K-block-major layout."""
    return random_scales(triton.cdiv(k, BLOCK), triton.cdiv(m, 4) * 4)[:, :m].t()


def bench_2d3d(m: int, n: int, k: int, g: int, offs: torch.Tensor, run_torch: bool, recipe: str) -> dict[str, float]:
    """ms of ours, torch fp8 and torch bf16 for out (M, N) = a (M, K) @ b[g]^T, b (G, N, K)."""
    a, sa = fp8_rows(m, k)
    b, sb = fp8_rows(n, k, g)
    if recipe == "blockwise":
        b_block_scales = random_scales(g, triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
        ours = functools.partial(grouped_mm_2d3d_blockwise, a, act_block_scales(m, k), b, b_block_scales, offs)
    else:
        ours = functools.partial(grouped_mm_2d3d, a, sa, b, sb, offs)
    if not run_torch:
        return {"ours": bench_us(ours) / 1e3}
    b_t = b.transpose(-2, -1)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    peers = {
        "ours": ours,
        "fp8": lambda: torch._scaled_grouped_mm(
            a, b_t, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "bf16": lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs),
    }
    return {name: us / 1e3 for name, us in bench_peers_us(peers).items()}


def bench_wgrad(m: int, n: int, k: int, g: int, offs: torch.Tensor, run_torch: bool, recipe: str) -> dict[str, float]:
    """ms of ours, torch fp8 and torch bf16 for out (G, N, K) = a_t (N, M) @ b_t (K, M)^T per group.

    Ours reads its operands in the layout our recipe's quantizer writes: rowwise, the
    padded token layout (each group from a multiple of 128 columns); ``plain``, the
    one torch reads (token t in column t); blockwise, the block space.
    """
    a_t, _ = fp8_rows(n, m)
    b_t, _ = fp8_rows(k, m)
    sa = random_scales(g, n)
    sb = random_scales(g, k)
    if recipe == "blockwise":
        # Per-group 128-token blocks, packed group after group (quantize_blockwise_cols_grouped's map),
        # the operands in its block space: (rows, R * 128), block r in columns [128 r, 128 r + 128).
        blocks = (torch.diff(offs, prepend=offs.new_zeros(1)) + BLOCK - 1) // BLOCK
        starts = (torch.cumsum(blocks, 0) - blocks).to(torch.int32)
        rows = triton.cdiv(m, BLOCK) + g
        a_blocks, _ = fp8_rows(n, rows * BLOCK)
        b_blocks, _ = fp8_rows(k, rows * BLOCK)
        ours = functools.partial(
            grouped_mm_wgrad_blockwise, a_blocks, random_scales(rows, n), b_blocks, random_scales(rows, k), offs, starts
        )
    elif recipe == "plain":
        ours = functools.partial(grouped_mm_wgrad, a_t, sa, b_t, sb, offs)
    else:
        columns = padded_token_count(m, g, WGRAD_GROUP_ALIGNMENT)
        a_pad, _ = fp8_rows(n, columns)
        b_pad, _ = fp8_rows(k, columns)
        ours = functools.partial(grouped_mm_wgrad, a_pad, sa, b_pad, sb, offs, group_alignment=WGRAD_GROUP_ALIGNMENT)
    if not run_torch:
        return {"ours": bench_us(ours) / 1e3}
    b_cm = b_t.t()  # (M, K) column-major
    a16, b16 = a_t.to(torch.bfloat16), b_t.to(torch.bfloat16)
    peers = {
        "ours": ours,
        "fp8": lambda: torch._scaled_grouped_mm(
            a_t, b_cm, sa.reshape(-1), sb.reshape(-1), offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "bf16": lambda: torch._grouped_mm(a16, b16.t(), offs=offs),
    }
    return {name: us / 1e3 for name, us in bench_peers_us(peers).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="rowwise", choices=RECIPES, help="which of our kernels to time")
    shape_set = parser.add_mutually_exclusive_group()
    shape_set.add_argument("--quick", action="store_true", help="first two shapes, skewed routing only")
    shape_set.add_argument(
        "--fine-grained",
        action="store_true",
        help="the fine-grained MoE shapes (128 and 256 experts), routings uniform, skewed and sparse",
    )
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()
    if args.fine_grained:
        shapes, routings = FINE_GRAINED_SHAPES, list(ALIGNED_ROUTINGS)
    elif args.quick:
        shapes, routings = SHAPES[:2], ["skewed"]
    else:
        shapes, routings = SHAPES, ["uniform", "skewed", "unaligned"]
    rows = []
    ratios_fp8: list[float] = []
    ratios_bf16: list[float] = []
    for name, m, n, k, g in shapes:
        for routing in routings:
            sizes = routed_group_sizes(m, g, routing)
            offs = offsets(sizes)
            tokens = sum(sizes)
            run_torch = routing != "unaligned"
            roles = {
                "forward": lambda: bench_2d3d(m, n, k, g, offs, run_torch, args.recipe),
                "dgrad": lambda: bench_2d3d(m, k, n, g, offs, run_torch, args.recipe),
                "wgrad": lambda: bench_wgrad(m, n, k, g, offs, run_torch, args.recipe),
            }
            if args.recipe == "rowwise":  # ours on torch's operand layout, for reference
                roles["wgrad, plain layout"] = lambda: bench_wgrad(m, n, k, g, offs, False, "plain")
            for role, fn in roles.items():
                times = fn()
                tflops = {key: 2 * tokens * n * k / (ms * 1e-3) / 1e12 for key, ms in times.items()}
                vs_fp8 = times["fp8"] / times["ours"] if "fp8" in times else math.nan
                vs_bf16 = times["bf16"] / times["ours"] if "bf16" in times else math.nan
                if "fp8" in times:
                    ratios_fp8.append(vs_fp8)
                    ratios_bf16.append(vs_bf16)
                row = (
                    f"| {name} ({m},{n},{k},{g}) | {routing} | {role} | {tflops['ours']:.0f} | "
                    f"{tflops.get('fp8', math.nan):.0f} | {tflops.get('bf16', math.nan):.0f} | "
                    f"{vs_fp8:.3f} | {vs_bf16:.3f} |"
                )
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()

    def geomean(xs: list[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan

    header = [
        f"# FP8 grouped GEMM ({args.recipe} scales), {datetime.date.today()}",
        "",
        f"GPU {torch.cuda.get_device_name()}, "
        + ", ".join(f"{name} {version}" for name, version in library_versions().items())
        + ". TFLOP/s (2*tokens*N*K / median time; peers timed in 4 rounds of rotating order, "
        "median per peer); ours vs "
        "torch._scaled_grouped_mm (fp8, rowwise, fast accum) and torch._grouped_mm (bf16). "
        "Skewed routing: Dirichlet(1) group sizes, multiples of 16."
        + (" Sparse routing: Dirichlet(0.3), multiples of 16, some experts get no tokens." if "sparse" in routings else "")
        + (" Unaligned routing: ours only (torch needs 16-aligned groups)." if "unaligned" in routings else ""),
        "",
        "| shape (M,N,K,G) | routing | role | ours | torch fp8 | torch bf16 | ours/fp8 | ours/bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    footer = [
        "",
        f"Geomean ours/fp8: {geomean(ratios_fp8):.3f} (min {min(ratios_fp8, default=math.nan):.3f}); "
        f"geomean ours/bf16: {geomean(ratios_bf16):.3f}",
    ]
    table = "\n".join(header + rows + footer) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
