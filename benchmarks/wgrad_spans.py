"""The wgrad GEMMs reading each group's token span from a table against finding it from ``offs``.

    python -m benchmarks.wgrad_spans [--shapes NAME ...] [--out FILE]

Every program of ``grouped_mm_wgrad`` (FP8) and ``grouped_mm_wgrad_bf16`` needs its group's token
span. ``group_token_span`` finds it from ``offs`` (G lanes loaded and reduced, in every program);
with ``token_groups.SPAN_TABLE`` the launcher makes every group's span once (``group_token_spans``,
one launch, its time included) and each program loads its group's values. Shapes of the MoE layer's
wgrads (the bf16 one with ``x``'s rows gathered by index, as the layer runs it), a new ``dW`` and
adding into a bf16 ``.grad``; peers in rotating order (``bench_peers_us``); ``same`` compares the
two results' bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table, with_setting
from kernels_helion import grouped_gemm_wgrad, grouped_mm_wgrad_bf16, token_groups
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from kernels_helion.tuning import fp8_operands, routed_offsets

SHAPES = {
    "dsv3-256-w13": (65536, 4096, 7168, 256),
    "dsv3-256-w2": (65536, 7168, 2048, 256),
    "qwen3-32k-w13": (262144, 1536, 2048, 128),
    "qwen3-32k-w2": (262144, 2048, 768, 128),
    "qwen3-8k-w13": (65536, 1536, 2048, 128),
    "bf16 dsv3-256-w1": (65536, 2048, 7168, 256),
    "bf16 dsv3-256-w2": (65536, 7168, 2048, 256),
    "bf16 qwen3-8k-w1": (65536, 768, 2048, 128),
}


def run_shape(name: str) -> list[dict[str, object]]:
    m, n, k, g = SHAPES[name]
    offs = routed_offsets(m, g, "cuda")
    if name.startswith("bf16"):
        # grad_out's pair rows and x's token rows read by index (top-8 routing: m / 8 tokens).
        a = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(m // 8, k, device="cuda", dtype=torch.bfloat16)
        index = torch.randint(0, m // 8, (m,), device="cuda", dtype=torch.int32)

        def wgrad(out: torch.Tensor | None) -> torch.Tensor:
            return grouped_mm_wgrad_bf16(a, b, offs, index=index, out=out)
    else:
        columns = padded_token_count(m, g, WGRAD_GROUP_ALIGNMENT)
        a_t, _ = fp8_operands(n, columns, device="cuda")
        b_t, _ = fp8_operands(k, columns, device="cuda")
        sa = torch.rand(g, n, device="cuda") + 0.5
        sb = torch.rand(g, k, device="cuda") + 0.5

        def wgrad(out: torch.Tensor | None) -> torch.Tensor:
            return grouped_gemm_wgrad.grouped_mm_wgrad(
                a_t, sa, b_t, sb, offs, out=out, group_alignment=WGRAD_GROUP_ALIGNMENT)
    rows = []
    for target in ("new dW", ".grad"):
        grad = torch.zeros(g, n, k, device="cuda", dtype=torch.bfloat16) if target == ".grad" else None

        def call(given: bool):  # noqa: ANN202
            return with_setting(token_groups, "SPAN_TABLE", given, lambda: wgrad(grad))

        results = {}
        for given in (True, False):
            if grad is not None:
                grad.zero_()
            results[given] = call(given)().clone()
        same = torch.equal(results[True], results[False])
        results.clear()
        times = bench_peers_us({"table": call(True), "offs": call(False)})
        rows.append({"shape": name, "target": target, "offs_us": times["offs"], "table_us": times["table"],
                     "speedup": times["offs"] / times["table"], "bitwise": same})
        print(rows[-1], flush=True)
        grad = None
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for name in args.shapes for row in run_shape(name)]
    command = "python -m benchmarks.wgrad_spans " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (M, N, K, G)", "dW", "spans from offs us", "spans from a table us", "speed-up", "same bits"],
        [[f"{r['shape']} {SHAPES[r['shape']]}", r["target"], r["offs_us"], r["table_us"], r["speedup"], r["bitwise"]]
         for r in rows],
    )
    report = environment_header("wgrad GEMMs: group spans from a table") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
