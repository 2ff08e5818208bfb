"""The 2D x 3D GEMM reading each row item from a table against finding it from ``offs``.

    python -m benchmarks.work_item_table [--shapes NAME ...] [--out FILE]

Every program iteration of ``grouped_mm_2d3d`` (one row item, one column tile) needs its item's
group and rows. ``work_item_rows`` finds them from ``offs`` (G lanes loaded, a prefix sum and five
reductions, before the K loop's first load); with ``grouped_gemm.WORK_ITEM_TABLE`` the launcher
makes every item's once (``work_item_table``, one launch, its time included) and the program loads
three values. The MoE layer's 2D x 3D shapes (``rows``: pairs reading token rows by index, as
``w2``'s dgrad on token rows does); peers in rotating order (``bench_peers_us``); ``same``
compares the two results' bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table, with_setting
from kernels_helion import grouped_gemm, grouped_mm_2d3d
from kernels_helion.tuning import fp8_operands, routed_offsets

# name -> (pairs M, tokens T read by index (0: none), N, K, G)
SHAPES = {
    "qwen3-32k w2 forward": (262144, 0, 2048, 768, 128),
    "qwen3-32k w1+w3 dgrad": (262144, 0, 2048, 1536, 128),
    "qwen3-32k w2 dgrad, token rows": (262144, 32768, 768, 2048, 128),
    "qwen3-8k w2 forward": (65536, 0, 2048, 768, 128),
    "qwen3-8k w1+w3 dgrad": (65536, 0, 2048, 1536, 128),
    "dsv3-256 w2 forward": (65536, 0, 7168, 2048, 256),
    "dsv3-256 w1+w3 dgrad": (65536, 0, 7168, 4096, 256),
    "dsv3-256 w2 dgrad, token rows": (65536, 8192, 2048, 7168, 256),
}


def run_shape(name: str) -> dict[str, object]:
    m, tokens, n, k, g = SHAPES[name]
    offs = routed_offsets(m, g, "cuda")
    rows = torch.randint(0, tokens, (m,), device="cuda", dtype=torch.int32) if tokens else None
    a, a_scales = fp8_operands(tokens or m, k, device="cuda")
    b, b_scales = fp8_operands(g, n, k, device="cuda")

    def gemm() -> torch.Tensor:
        return grouped_mm_2d3d(a, a_scales, b, b_scales, offs, rows=rows)

    def call(table: bool):  # noqa: ANN202
        return with_setting(grouped_gemm, "WORK_ITEM_TABLE", table, gemm)

    same = torch.equal(call(True)(), call(False)())
    times = bench_peers_us({"table": call(True), "offs": call(False)})
    row = {"shape": name, "offs_us": times["offs"], "table_us": times["table"],
           "speedup": times["offs"] / times["table"], "bitwise": same}
    print(row, flush=True)
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [run_shape(name) for name in args.shapes]
    command = "python -m benchmarks.work_item_table " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["GEMM (M, T by index, N, K, G)", "items from offs us", "items from a table us", "speed-up",
         "same bits"],
        [[f"{r['shape']} {SHAPES[r['shape']]}", r["offs_us"], r["table_us"], r["speedup"], r["bitwise"]] for r in rows],
    )
    report = environment_header("2D x 3D GEMM: row items from a table") + f"- command: `{command.strip()}`\n\n{table}"
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
