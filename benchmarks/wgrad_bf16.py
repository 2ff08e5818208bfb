"""The 16-bit MoE wgrad: our Helion kernel (rows gathered by index, gradient added in its epilogue) against torch.

For each fine-grained MoE weight (Qwen3-30B-A3B, DeepSeek-V3) and each way the
gradient is kept, one step's wgrad work:

- ``torch``: ``torch._grouped_mm`` (CUTLASS) on ``x`` gathered to the routed pairs
  (``index_select``, for the up-projection's weights, which read tokens), then, when
  accumulating, ``grad += dW`` (autograd's add, or ``main_grad``'s);
- ``ours``: ``kernels_helion.grouped_mm_wgrad_bf16``, reading the tokens by index and
  adding into the gradient in its epilogue.

Modes: ``fresh`` (a new bf16 dW), ``.grad`` (added into a bf16 gradient), ``main_grad``
(added into an fp32 one). Each row checks ours against torch (max |difference| over
max |torch|). Peers are timed in rotating order (``benchmarks.common.bench_peers_us``).

    python -m benchmarks.wgrad_bf16 [--shapes qwen3-8k-up ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table
from kernels_helion import grouped_mm_wgrad_bf16

# name -> (pairs P, tokens T, N, K, groups G, whether b is gathered from the T tokens).
# The up-projection's wgrad (per weight of w1 / w3) reads x's tokens by index; the
# down-projection's reads h's P rows.
SHAPES = {
    "qwen3-8k-up": (65536, 8192, 768, 2048, 128, True),
    "qwen3-8k-down": (65536, 65536, 2048, 768, 128, False),
    "qwen3-32k-up": (262144, 32768, 768, 2048, 128, True),
    "qwen3-32k-down": (262144, 262144, 2048, 768, 128, False),
    "dsv3-256-up": (65536, 8192, 2048, 7168, 256, True),
    "dsv3-256-down": (65536, 65536, 7168, 2048, 256, False),
}
MODES = ("fresh", ".grad", "main_grad")


def run_shape(name: str) -> list[dict[str, object]]:
    p, t, n, k, g, gather = SHAPES[name]
    torch.manual_seed(0)
    # a is a column slice of a 2N-wide tensor for the up-projection ([grad_gate | grad_up]).
    a_full = torch.randn(p, 2 * n if gather else n, device="cuda", dtype=torch.bfloat16)
    a = a_full[:, :n]
    b = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, t, (p,), device="cuda", dtype=torch.int32) if gather else None
    offs = (torch.arange(1, g + 1, device="cuda", dtype=torch.int64) * p // g).to(torch.int32)
    rows = []
    for mode in MODES:
        dtype = torch.float32 if mode == "main_grad" else torch.bfloat16
        grad_torch = torch.zeros(g, n, k, device="cuda", dtype=dtype)
        grad_ours = torch.zeros(g, n, k, device="cuda", dtype=dtype)

        def torch_step(grad=grad_torch) -> None:
            x = b.index_select(0, index) if gather else b
            dw = torch._grouped_mm(a.t(), x, offs=offs)
            if mode != "fresh":
                grad.add_(dw)

        def ours_step(grad=grad_ours) -> None:
            grouped_mm_wgrad_bf16(a, b, offs, index=index, out=None if mode == "fresh" else grad)

        # Correctness at this shape: one call of each from zeros.
        if mode == "fresh":
            ref = torch._grouped_mm(a.t(), b.index_select(0, index) if gather else b, offs=offs).float()
            got = grouped_mm_wgrad_bf16(a, b, offs, index=index).float()
        else:
            torch_step()
            ours_step()
            ref, got = grad_torch.float(), grad_ours.float()
        error = ((got - ref).abs().max() / ref.abs().max()).item()
        times = bench_peers_us({"torch": torch_step, "ours": ours_step})
        flops = 2 * p * n * k
        rows.append({
            "shape": name, "mode": mode, "torch_us": times["torch"], "ours_us": times["ours"],
            "speedup": times["torch"] / times["ours"], "ours_tflops": flops / times["ours"] / 1e6,
            "rel_error": error,
        })
        print(rows[-1], flush=True)
        del grad_torch, grad_ours
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for name in args.shapes for row in run_shape(name)]
    command = "python -m benchmarks.wgrad_bf16 " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (P, T, N, K, G)", "mode", "torch us", "ours us", "ours / torch speed", "ours TFLOP/s", "max rel diff"],
        [[f"{r['shape']} {SHAPES[r['shape']][:5]}", r["mode"], r["torch_us"], r["ours_us"], r["speedup"],
          r["ours_tflops"], f"{r['rel_error']:.1e}"] for r in rows],
    )
    report = environment_header("16-bit MoE wgrad: rows by index, gradient added in the epilogue") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
