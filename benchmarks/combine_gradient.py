"""The MoE combine's gradient rows for the down-projection's FP8 backward: written out, or read by index.

With a folded dgrad and an FP8 wgrad, ``w2``'s backward quantizes the combine's gradient rows
``grad[token of s] * prob of s`` (one per sorted pair ``s``) both ways
(``quantize_rowwise_rows_and_cols_grouped``: the folded rowwise form and the per-group column form).
Two ways, per MoE layer config (uniform random top-k routing), both checked bitwise equal:

- ``apart us``: ``moe_combine_grad_rows`` writes the ``(T * k, D)`` rows in bf16, then the two-pass
  quantizer reads them (the combine as an op of its own);
- ``by index us``: the two-pass quantizer reads each pair's token row of ``grad (T, D)`` and
  multiplies it by its probability (``pair_tokens`` / ``pair_weights``;
  ``ops.moe_fused.down_projection_combine``).

Kernel time from CUDA-graph replays with a cold L2 (``bench_kernel_us``), the two ways in rotating order.

    python -m benchmarks.combine_gradient [--configs qwen3-8k ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import ops
from benchmarks.common import bench_kernel_us, emit_report, environment_header, markdown_table
from kernels_helion import moe_combine_grad_rows, quantize_rowwise_rows_and_cols_grouped

# name -> (tokens T, top-k, dim D, experts E): the MoE layer benchmark's configs.
CONFIGS = {
    "qwen3-8k": (8192, 8, 2048, 128),
    "qwen3-32k": (32768, 8, 2048, 128),
    "dsv3-256": (8192, 8, 7168, 256),
    "dsv3-32": (32768, 8, 7168, 32),
}


def run_config(name: str) -> dict[str, object]:
    tokens, top_k, dim, experts = CONFIGS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(tokens, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(tokens, top_k, generator=gen, device="cuda")
    choices = torch.rand(tokens, experts, generator=gen, device="cuda").topk(top_k, dim=1).indices
    order = ops.sort_by_expert(choices, experts)
    offs = torch.cumsum(order.num_tokens_per_expert, 0).to(torch.int32)
    pairs = tokens * top_k
    row_multipliers = torch.rand(experts, dim, generator=gen, device="cuda") + 0.5  # w2's forward scales
    token_multipliers = torch.rand(pairs, generator=gen, device="cuda") + 0.5  # h's row scales
    pair_tokens = (order.order // top_k).to(torch.int32)
    pair_weights = probs.view(-1)[order.order]
    y = torch.empty(pairs, dim, device="cuda", dtype=torch.bfloat16)  # its shape only

    def apart():
        rows = moe_combine_grad_rows(grad, order.order, probs)
        return quantize_rowwise_rows_and_cols_grouped(rows, offs, row_multipliers=row_multipliers,
                                                      token_multipliers=token_multipliers)

    def by_index():
        return quantize_rowwise_rows_and_cols_grouped(grad, offs, row_multipliers=row_multipliers,
                                                      token_multipliers=token_multipliers,
                                                      pair_tokens=pair_tokens, pair_weights=pair_weights)

    equal = all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                            b.view(torch.uint8) if b.element_size() == 1 else b)
                for a, b in zip(apart(), by_index()))
    times = {"apart": [], "by_index": []}
    for round_ in range(4):
        for key in (("apart", "by_index") if round_ % 2 == 0 else ("by_index", "apart")):
            times[key].append(bench_kernel_us(apart if key == "apart" else by_index))
    apart_us, by_index_us = (sorted(times[k])[len(times[k]) // 2] for k in ("apart", "by_index"))
    row = {"config": name, "T": tokens, "k": top_k, "D": dim, "E": experts, "bitwise_equal": equal,
           "apart_us": apart_us, "by_index_us": by_index_us}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [run_config(name) for name in args.configs]
    command = "python -m benchmarks.combine_gradient " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["config (T, k, D, E)", "bitwise equal", "apart us", "by index us", "by index vs apart"],
        [[f"{r['config']} ({r['T']}, {r['k']}, {r['D']}, {r['E']})", r["bitwise_equal"], r["apart_us"],
          r["by_index_us"], r["apart_us"] / r["by_index_us"]] for r in rows],
    )
    report = environment_header("The combine's gradient rows in the down-projection's FP8 backward") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
