"""The FP8 wgrad of several micro-batches: one accumulating GEMM per micro-batch against one GEMM over them all.

    python -m benchmarks.wgrad_merged [--shapes NAME ...] [--micro-batches N] [--out FILE]

With ``dW`` added into ``.grad`` by the wgrad GEMM, an optimizer step of ``N`` micro-batches runs
``N`` wgrads: the first writes ``dW``, the others read and write it again. At DeepSeek-V3-like 256
experts (about 256 pairs an expert) that gradient traffic bounds the GEMM. One wgrad over the
``N`` micro-batches' pairs together (each group's pairs of every micro-batch, ``N`` times the
contraction length) writes ``dW`` once. This times the two GEMM schedules alone, operands made
ready (their quantization scales with the pairs either way); peers in rotating order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table
from kernels_helion import grouped_gemm_wgrad
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from kernels_helion.tuning import fp8_operands, routed_offsets

# name -> (pairs of one micro-batch M, N, K, G)
SHAPES = {
    "dsv3-256-w13": (65536, 4096, 7168, 256),
    "dsv3-256-w2": (65536, 7168, 2048, 256),
    "qwen3-32k-w13": (262144, 1536, 2048, 128),
    "qwen3-32k-w2": (262144, 2048, 768, 128),
}


def wgrad_of(m: int, n: int, k: int, g: int):  # noqa: ANN201
    offs = routed_offsets(m, g, "cuda")
    columns = padded_token_count(m, g, WGRAD_GROUP_ALIGNMENT)
    a_t, _ = fp8_operands(n, columns, device="cuda")
    b_t, _ = fp8_operands(k, columns, device="cuda")
    sa = torch.rand(g, n, device="cuda") + 0.5
    sb = torch.rand(g, k, device="cuda") + 0.5

    def wgrad(out: torch.Tensor | None) -> torch.Tensor:
        return grouped_gemm_wgrad.grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out=out, group_alignment=WGRAD_GROUP_ALIGNMENT)
    return wgrad


def time_schedule(m: int, n: int, k: int, g: int, calls: int) -> float:
    """Microseconds of ``calls`` wgrads over ``m`` pairs each, adding into one bf16 gradient."""
    wgrad = wgrad_of(m, n, k, g)
    grad = torch.zeros(g, n, k, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        for _ in range(calls):
            wgrad(grad)

    us = bench_peers_us({"step": step})["step"]
    torch.cuda.empty_cache()
    return us


def run_shape(name: str, micro_batches: int) -> dict[str, object]:
    m, n, k, g = SHAPES[name]
    separate = time_schedule(m, n, k, g, micro_batches)
    merged = time_schedule(m * micro_batches, n, k, g, 1)
    row = {"shape": name, "micro_batches": micro_batches, "separate_us": separate, "merged_us": merged,
           "speedup": separate / merged}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [run_shape(name, args.micro_batches) for name in args.shapes]
    command = "python -m benchmarks.wgrad_merged " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (M of one micro-batch, N, K, G)", "micro-batches", "one wgrad each, into .grad us",
         "one wgrad over all, into .grad us", "speed-up"],
        [[f"{r['shape']} {SHAPES[r['shape']]}", r["micro_batches"], r["separate_us"], r["merged_us"], r["speedup"]]
         for r in rows],
    )
    report = environment_header("FP8 wgrad of several micro-batches: separate or merged") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
