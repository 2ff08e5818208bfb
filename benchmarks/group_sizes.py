"""Grouped GEMM tiles on equal group sizes and on the sizes a router gives.

A grouped GEMM cuts each group's rows into tiles from the group's start, so a group
whose size is not a multiple of the row tile ends in a partial tile that costs a
whole tile's K loop. Equal sizes that the tile divides (how kernels were tuned before
``kernels_helion.tuning.routed_offsets``) never pay it; a layer's routed sizes do.
For each of the tuning space's configs of the 2D x 3D GEMM (``grouped_mm_2d3d``) and
the fused up-projection (``grouped_mm_swiglu``), at an MoE layer's shape, this times:

- ``equal us``: every group ``M / G`` rows;
- ``routed us``: the group sizes of the layer benchmark's uniform routing (``ops.MoE``'s
  router on random tokens, seed 0, as ``benchmarks.moe_layer`` builds it).

Kernel time from CUDA-graph replays with a cold L2 (``bench_kernel_us``); the first
row of each case is the config the shipped cache selects.

    python -m benchmarks.group_sizes [--cases mm:qwen3-8k:65536:2048:768:128 ...] [--out FILE]

A case is ``kernel:layer:M:N:K:G`` with ``kernel`` ``mm`` (``grouped_mm_2d3d``) or
``swiglu`` (``grouped_mm_swiglu``) and ``layer`` a ``benchmarks.moe_layer`` config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import ops
from autotune_cache import forced_config, select_config
from autotune_cache.registry import tunable_kernels
from benchmarks.common import bench_kernel_us, emit_report, environment_header, markdown_table
from benchmarks.moe_layer import CONFIGS as LAYERS
from kernels_helion import grouped_mm_2d3d
from kernels_helion.grouped_gemm_swiglu import grouped_mm_swiglu
from kernels_helion.tuning import fp8_operands

DEFAULT_CASES = (
    "mm:qwen3-8k:65536:2048:768:128",
    "swiglu:qwen3-8k:65536:768:2048:128",
    "mm:dsv3-256:65536:7168:2048:256",
    "swiglu:dsv3-256:65536:2048:7168:256",
)
KERNELS = {"mm": "grouped_mm_2d3d", "swiglu": "grouped_mm_swiglu"}


def routed_layer_offsets(layer: str, device: torch.device) -> torch.Tensor:
    """The group ends of ``layer``'s uniform routing in ``benchmarks.moe_layer`` (seed 0)."""
    shape = LAYERS[layer]
    config = shape.layer
    torch.manual_seed(0)
    moe = ops.MoE(config.dim, config.hidden, config.experts, config.top_k, device=device)
    x = torch.randn(shape.tokens, config.dim, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        _, experts = moe.route(x)
    counts = torch.bincount(experts.flatten(), minlength=config.experts)
    return torch.cumsum(counts, 0).to(torch.int32)


def call_builder(kind: str, m: int, n: int, k: int, g: int, device: torch.device) -> Callable[[torch.Tensor], Callable]:
    """``offs -> call`` of the case's kernel on random FP8 operands."""
    if kind == "mm":
        a, a_scales = fp8_operands(m, k, device=device)
        b, b_scales = fp8_operands(g, n, k, device=device)
        return lambda offs: (lambda: grouped_mm_2d3d(a, a_scales, b, b_scales, offs))
    tokens = max(m // 8, 1)
    a, a_scales = fp8_operands(tokens, k, device=device)
    gate, gate_scales = fp8_operands(g, n, k, device=device)
    up, up_scales = fp8_operands(g, n, k, device=device)
    rows = torch.randint(0, tokens, (m,), dtype=torch.int32, device=device)
    return lambda offs: (lambda: grouped_mm_swiglu(a, a_scales, rows, gate, gate_scales, up, up_scales, offs))


def run_case(case: str) -> list[dict[str, object]]:
    kind, layer, *dims = case.split(":")
    m, n, k, g = (int(v) for v in dims)
    device = torch.device("cuda")
    name = KERNELS[kind]
    routed = routed_layer_offsets(layer, device)
    if routed.shape[0] != g or int(routed[-1]) != m:
        raise ValueError(f"{case}: the {layer} layer routes {int(routed[-1])} rows to {routed.shape[0]} groups")
    sizes = torch.diff(routed, prepend=routed.new_zeros(1))
    equal = (torch.arange(1, g + 1, device=device) * m // g).to(torch.int32)
    build = call_builder(kind, m, n, k, g, device)
    on_equal, on_routed = build(equal), build(routed)
    spec = tunable_kernels()[name]
    shipped = select_config(name, {"M": m, "N": n, "K": k, "G": g}, spec.default_config)
    rows = []
    for i, config in enumerate([shipped] + [c for c in spec.space("sm90") if c != shipped]):
        with forced_config(name, config):
            equal_us, routed_us = bench_kernel_us(on_equal), bench_kernel_us(on_routed)
        row = {
            "case": case, "kernel": name, "layer": layer, "routed_sizes": [int(sizes.min()), int(sizes.max())],
            "shipped": i == 0, "config": dict(config.config), "equal_us": equal_us, "routed_us": routed_us,
        }
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for case in args.cases for row in run_case(case)]
    command = "python -m benchmarks.group_sizes " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["kernel", "layer (routed sizes)", "config: tile, warps, stages", "equal us", "routed us", "routed / equal"],
        [[r["kernel"] + (" (shipped)" if r["shipped"] else ""), f"{r['layer']} ({r['routed_sizes'][0]}-{r['routed_sizes'][1]})",
          f"{r['config']['block_sizes']}, {r['config']['num_warps']}, {r['config']['num_stages']}",
          r["equal_us"], r["routed_us"], r["routed_us"] / r["equal_us"]] for r in rows],
    )
    report = environment_header("Grouped GEMM tiles on equal and on routed group sizes") + (
        f"- command: `{command.strip()}`\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
