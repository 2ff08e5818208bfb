"""The FP8 wgrad adding into a gradient, with and without an L2 prefetch of the gradient's tile.

    python -m benchmarks.wgrad_prefetch [--shapes NAME ...] [--out FILE]

``grouped_mm_wgrad`` adding its ``dW`` into a bf16 ``.grad`` and into an fp32 ``main_grad``
runs with ``kernels_helion.l2_prefetch.PREFETCH_GRADIENT`` on and off, at the MoE layer
benchmark's per-weight shapes, peers timed in rotating order (``bench_peers_us``). Both must
leave the same bits in the gradient (the prefetch changes no arithmetic); a row says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table
from benchmarks.wgrad_bf16 import SHAPES
from kernels_helion import grouped_mm_wgrad, l2_prefetch
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT


def _with_prefetch(on: bool, fn):  # noqa: ANN001, ANN202
    def call() -> object:
        l2_prefetch.PREFETCH_GRADIENT = on
        try:
            return fn()
        finally:
            l2_prefetch.PREFETCH_GRADIENT = True

    return call


def run_shape(name: str) -> list[dict[str, object]]:
    p, t, n, k, g, gather = SHAPES[name]
    torch.manual_seed(0)
    a = torch.randn(p, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, t, (p,), device="cuda", dtype=torch.int32) if gather else None
    offs = (torch.arange(1, g + 1, device="cuda", dtype=torch.int64) * p // g).to(torch.int32)
    # The FP8 wgrad's operands: token-major FP8 bytes with per-(group, column) scales, in the
    # padded token layout (the uniform groups here are multiples of its alignment).
    a_t = (a.t().contiguous() * 0.25).to(torch.float8_e4m3fn)
    b_t = ((b.index_select(0, index) if gather else b).t().contiguous() * 0.25).to(torch.float8_e4m3fn)
    a_scales = torch.rand(g, n, device="cuda") + 0.5
    b_scales = torch.rand(g, k, device="cuda") + 0.5
    kernels = {
        f"fp8 wgrad, {target}": (dtype, lambda out: grouped_mm_wgrad(
            a_t, a_scales, b_t, b_scales, offs, out=out, group_alignment=WGRAD_GROUP_ALIGNMENT))
        for target, dtype in ((".grad", torch.bfloat16), ("main_grad", torch.float32))
    }
    rows = []
    for kernel, (dtype, fn) in kernels.items():
        grads = {on: torch.zeros(g, n, k, device="cuda", dtype=dtype) for on in (True, False)}
        for on in (True, False):
            _with_prefetch(on, lambda on=on: fn(grads[on]))()
        same = torch.equal(grads[True], grads[False])
        times = bench_peers_us({
            "prefetch": _with_prefetch(True, lambda: fn(grads[True])),
            "none": _with_prefetch(False, lambda: fn(grads[False])),
        })
        rows.append({"shape": name, "kernel": kernel, "none_us": times["none"], "prefetch_us": times["prefetch"],
                     "speedup": times["none"] / times["prefetch"], "bitwise": same})
        print(rows[-1], flush=True)
        grads.clear()
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["qwen3-8k-up", "qwen3-32k-down", "dsv3-256-up", "dsv3-256-down"],
                        choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for name in args.shapes for row in run_shape(name)]
    command = "python -m benchmarks.wgrad_prefetch " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (P, T, N, K, G)", "kernel", "no prefetch us", "prefetch us", "speed-up", "same bits"],
        [[f"{r['shape']} {SHAPES[r['shape']][:5]}", r["kernel"], r["none_us"], r["prefetch_us"], r["speedup"],
          r["bitwise"]] for r in rows],
    )
    report = environment_header("wgrad into a gradient: L2 prefetch of the gradient's tile") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
