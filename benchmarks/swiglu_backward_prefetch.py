"""The down-projection's dgrad with SwiGLU's backward in its epilogue, gate/up read early or prefetched into L2.

    python -m benchmarks.swiglu_backward_prefetch [--shapes NAME ...] [--out FILE]

``grouped_mm_swiglu_backward`` reads each tile's ``gate``/``up`` rows either into registers
before the K loop (``PREFETCH_GATE_UP`` off), where they stay live through it, or asks L2
for them before the loop and loads them after it (on). Each tile config of the sweep runs
both ways, peers timed in rotating order (``bench_peers_us``) beside the unfused pair the
fused kernel replaces (``grouped_mm_2d3d`` then ``swiglu_backward_weighted``, their selected
configs). Both ways must give the same bits (the prefetch changes no arithmetic); a row says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kernels_helion  # noqa: F401, I001  (before helion: torch compatibility)
import helion
import torch
from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table
from kernels_helion import grouped_gemm_swiglu_backward as fused
from kernels_helion import grouped_mm_2d3d, swiglu_backward_weighted
from kernels_helion.tuning import fp8_operands, random_bf16, routed_offsets

# name: (M pairs, H hidden columns, D = K, experts): the MoE layer benchmark's down-projections.
SHAPES = {
    "qwen3-8k": (65536, 768, 2048, 128),
    "qwen3-32k": (262144, 768, 2048, 128),
    "dsv3-256": (65536, 2048, 7168, 256),
}
# [BLOCK_M, BLOCK_N, BLOCK_K], warps.
TILES = (([128, 64, 128], 8), ([128, 128, 128], 8), ([128, 128, 64], 8), ([128, 128, 128], 4), ([64, 128, 128], 4))


def _config(block_sizes: list[int], warps: int) -> helion.Config:
    return helion.Config(block_sizes=block_sizes, num_warps=warps, num_stages=3, l2_groupings=[8],
                         pid_type="persistent_interleaved")


def _fused(config: helion.Config, prefetch: bool, args: tuple[torch.Tensor, ...]):  # noqa: ANN202
    def call() -> object:
        chosen, fused.select_config = fused.select_config, lambda name, key, default: config
        fused.PREFETCH_GATE_UP = prefetch
        try:
            return fused.grouped_mm_swiglu_backward(*args)
        finally:
            fused.select_config, fused.PREFETCH_GATE_UP = chosen, True

    return call


def run_shape(name: str) -> list[dict[str, object]]:
    m, n, k, g = SHAPES[name]
    torch.manual_seed(0)
    device = torch.device("cuda")
    a, a_scales = fp8_operands(m, k, device=device)
    b, b_scales = fp8_operands(g, n, k, device=device)
    gate_up = random_bf16(m, 2 * n, device=device)
    weights = torch.rand(m, device=device)
    offs = routed_offsets(m, g, device)
    args = (a, a_scales, b, b_scales, offs, gate_up, weights)

    def unfused() -> object:
        unit = grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype=gate_up.dtype)
        return swiglu_backward_weighted(unit, gate_up, weights)

    rows = []
    for block_sizes, warps in TILES:
        config = _config(block_sizes, warps)
        try:
            outs = {on: _fused(config, on, args)() for on in (True, False)}
        except Exception as error:  # noqa: BLE001  (a config that does not compile is a row, not a failure)
            rows.append({"shape": name, "tile": block_sizes, "warps": warps, "error": repr(error)[:200]})
            print(rows[-1], flush=True)
            continue
        same = all(torch.equal(x, y) for x, y in zip(outs[True], outs[False]))
        times = bench_peers_us({"prefetch": _fused(config, True, args), "early": _fused(config, False, args),
                                "unfused": unfused})
        rows.append({"shape": name, "tile": block_sizes, "warps": warps, "early_us": times["early"],
                     "prefetch_us": times["prefetch"], "unfused_us": times["unfused"],
                     "speedup": times["early"] / times["prefetch"], "bitwise": same})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["qwen3-8k", "qwen3-32k"], choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for name in args.shapes for row in run_shape(name)]
    command = "python -m benchmarks.swiglu_backward_prefetch " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (M, H, D, E)", "tile", "warps", "early us", "prefetch us", "speed-up", "unfused pair us", "same bits"],
        [[f"{r['shape']} {SHAPES[r['shape']]}", r["tile"], r["warps"], r.get("early_us", r.get("error")),
          r.get("prefetch_us", "-"), r.get("speedup", "-"), r.get("unfused_us", "-"), r.get("bitwise", "-")]
         for r in rows],
    )
    report = environment_header("SwiGLU's backward in the dgrad epilogue: gate/up early or prefetched") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
