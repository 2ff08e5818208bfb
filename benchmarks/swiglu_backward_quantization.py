"""SwiGLU's backward for an FP8 wgrad: its gradient written out, or computed inside the quantizer.

With an FP8 wgrad the fused up-projection's backward needs both folded FP8 forms of
``grad_gate_up = swiglu_backward(grad_h, gate_up)``: dgrad's rows (times the forward
weight scales) and the wgrad's per-(group, column) form (times each pair's token
scale). Two ways, bitwise the same outputs (checked here):

- ``written out``: ``swiglu_backward`` stores ``grad_gate_up`` in bf16, then the two-pass
  quantizer (``quantize_rowwise_rows_and_cols_grouped``) reads it in each pass;
- ``inside the quantizer``: both passes compute it from ``grad_h`` and ``gate_up``
  (``quantize_rowwise_rows_and_cols_grouped(grad_h, ..., gate_up=gate_up)``); it is never stored.

Per MoE layer config that runs an FP8 wgrad, at the up-projection's backward shape
(``P`` pairs, hidden ``H``, ``E`` experts, uniform groups); peers timed in rotating
order (``bench_peers_us``).

    python -m benchmarks.swiglu_backward_quantization [--configs qwen3-32k dsv3-32] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table
from kernels_helion import quantize_rowwise_rows_and_cols_grouped, swiglu_backward

# name -> (pairs P, hidden H, experts E): the MoE layer benchmark's configs with an FP8 wgrad (top-8, 32768 tokens).
CONFIGS = {
    "qwen3-32k": (262144, 768, 128),
    "dsv3-32": (262144, 2048, 32),
}


def run_config(name: str) -> dict[str, object]:
    p, h, e = CONFIGS[name]
    torch.manual_seed(0)
    grad_h = torch.randn(p, h, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(p, 2 * h, device="cuda", dtype=torch.bfloat16) * 2
    offs = (torch.arange(1, e + 1, device="cuda", dtype=torch.int64) * p // e).to(torch.int32)
    folds = {
        "row_multipliers": torch.rand(e, 2 * h, device="cuda") + 0.5,
        "token_multipliers": torch.rand(p, device="cuda") + 0.5,
    }

    def written_out():
        return quantize_rowwise_rows_and_cols_grouped(swiglu_backward(grad_h, gate_up), offs, **folds)

    def inside():
        return quantize_rowwise_rows_and_cols_grouped(grad_h, offs, gate_up=gate_up, **folds)

    for a, b in zip(written_out(), inside(), strict=True):
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
        if not same:
            raise AssertionError(f"{name}: the two ways differ")
    times = bench_peers_us({"written out": written_out, "inside the quantizer": inside})
    row = {"config": name, "P": p, "H": h, "E": e, "written_out_us": times["written out"],
           "inside_us": times["inside the quantizer"], "bitwise_equal": True}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [run_config(name) for name in args.configs]
    command = "python -m benchmarks.swiglu_backward_quantization " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["config (P, H, E)", "written out us", "inside the quantizer us", "speedup", "outputs"],
        [[f"{r['config']} ({r['P']}, {r['H']}, {r['E']})", r["written_out_us"], r["inside_us"],
          r["written_out_us"] / r["inside_us"], "bitwise equal"] for r in rows],
    )
    report = environment_header("SwiGLU's backward for an FP8 wgrad: written out, or inside the quantizer") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
