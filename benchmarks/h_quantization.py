"""The down-projection's input ``h``: a rowwise scale (today) or 1x128 block scales, what each costs.

A rowwise scale of ``h`` spans its whole hidden row, wider than the fused
up-projection's epilogue tile, so today ``grouped_mm_swiglu`` stores ``h`` in bf16
and ``quantize_rowwise_rows`` quantizes it in a pass of its own before the rowwise
``w2`` GEMM. With 1x128 block scales the epilogue could cast ``h`` itself (a block
lies inside a tile), but the ``w2`` GEMM then scales every 128-wide K step
(``grouped_mm_2d3d_blockwise``). Per MoE layer config, at ``w2``'s forward shape:

- ``quantize us``: today's pass over ``h`` (the most any way out can save);
- ``rowwise GEMM us``: today's ``w2`` GEMM (``grouped_mm_2d3d``);
- ``1x128 GEMM us``: the block-scaled ``w2`` GEMM (its quantization counted as free).

Kernel time from CUDA-graph replays with a cold L2 (``bench_kernel_us``).

    python -m benchmarks.h_quantization [--configs qwen3-8k ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_kernel_us, emit_report, environment_header, markdown_table
from kernels_helion import (
    grouped_mm_2d3d,
    grouped_mm_2d3d_blockwise,
    quantize_blockwise_rows,
    quantize_blockwise_weights,
    quantize_rowwise_rows,
)

# name -> (pairs P, dim D, hidden H, experts E): the MoE layer benchmark's configs (top-8).
CONFIGS = {
    "qwen3-8k": (65536, 2048, 768, 128),
    "qwen3-32k": (262144, 2048, 768, 128),
    "dsv3-256": (65536, 7168, 2048, 256),
    "dsv3-32": (262144, 7168, 2048, 32),
}


def run_config(name: str) -> dict[str, object]:
    p, d, h, e = CONFIGS[name]
    torch.manual_seed(0)
    hidden = torch.randn(p, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(e, d, h, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = (torch.arange(1, e + 1, device="cuda", dtype=torch.int64) * p // e).to(torch.int32)
    h_rows, h_scales = quantize_rowwise_rows(hidden)
    w_rows, w_scales = quantize_rowwise_rows(w2.view(e * d, h))
    w_rows, w_scales = w_rows.view(e, d, h), w_scales.view(e, d)
    h_blocks, h_block_scales = quantize_blockwise_rows(hidden)
    w_blocks, w_block_scales = quantize_blockwise_weights(w2)
    quantize_us = bench_kernel_us(lambda: quantize_rowwise_rows(hidden))
    rowwise_us = bench_kernel_us(lambda: grouped_mm_2d3d(h_rows, h_scales, w_rows, w_scales, offs))
    blockwise_us = bench_kernel_us(
        lambda: grouped_mm_2d3d_blockwise(h_blocks, h_block_scales, w_blocks, w_block_scales, offs)
    )
    row = {"config": name, "P": p, "D": d, "H": h, "E": e, "quantize_us": quantize_us, "rowwise_gemm_us": rowwise_us,
           "blockwise_gemm_us": blockwise_us, "today_us": quantize_us + rowwise_us}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [run_config(name) for name in args.configs]
    command = "python -m benchmarks.h_quantization " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["config (P, D, H, E)", "quantize us", "rowwise GEMM us", "today: both us", "1x128 GEMM us",
         "1x128 (GEMM alone) vs today"],
        [[f"{r['config']} ({r['P']}, {r['D']}, {r['H']}, {r['E']})", r["quantize_us"], r["rowwise_gemm_us"],
          r["today_us"], r["blockwise_gemm_us"], r["today_us"] / r["blockwise_gemm_us"]] for r in rows],
    )
    report = environment_header("The down-projection's input: rowwise scales and their pass, or 1x128 blocks") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
