"""What group boundaries that fall inside a row tile cost the rowwise 2D x 3D grouped GEMM, against torch.

    python -m benchmarks.group_boundaries [--out FILE]

A kernel that tiles the output along the tensor's rows runs a 128-row tile that
holds rows of two groups once per group, and such tiles finish last (tensor-aligned
tiles lost 8-16% to them on the H200); ``grouped_mm_2d3d`` cuts its row tiles from each
group's start instead. Here the same shapes run with routings that differ only in
where the boundaries fall: equal groups aligned to the tile, one boundary off by 64 rows,
every boundary off by 16 rows (equal work otherwise), and one Dirichlet(1) sample
with its sizes rounded to 16 or to 128. Peers: ours, ours with a non-persistent
grid (``pid_type="flat"``: the hardware hands out tiles as SMs free up, where the
persistent grid deals them round-robin) and ``torch._scaled_grouped_mm`` (rowwise,
fast accumulation), timed in rotating order (``bench_peers_us``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kernels_helion  # noqa: F401  (before helion: kernels_helion.helion_setup)
import helion
import torch

from autotune_cache import forced_config, select_config
from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table, offsets, routed_group_sizes
from kernels_helion import grouped_mm_2d3d
from kernels_helion.grouped_gemm import DEFAULT_CONFIG

# (M, N, K, G): the forward and dgrad roles of the DeepSeek-V3 and 32-expert shapes.
SHAPES = ((32768, 2048, 7168, 8), (32768, 7168, 2048, 8), (65536, 2048, 7168, 32), (65536, 7168, 2048, 32))
ROW_TILE = 128


def routings(m: int, g: int) -> dict[str, list[int]]:
    """Group sizes by routing name; all but the skewed ones have equal total work."""
    size = m // g
    return {
        "aligned (equal groups)": [size] * g,
        "one boundary 64 rows off": [size - 64, size + 64] + [size] * (g - 2),
        "every boundary 16 rows off": [size - 16] + [size] * (g - 2) + [size + 16],
        "skewed, sizes multiples of 16": routed_group_sizes(m, g, "skewed", align=16),
        "skewed, same sample, multiples of 128": routed_group_sizes(m, g, "skewed", align=ROW_TILE),
    }


def boundary_tiles(sizes: list[int]) -> int:
    """Row tiles of ``ROW_TILE`` rows that hold rows of more than one (non-empty) group."""
    groups_in_tile: dict[int, int] = {}
    start = 0
    for size in sizes:
        if size:
            for tile in range(start // ROW_TILE, (start + size - 1) // ROW_TILE + 1):
                groups_in_tile[tile] = groups_in_tile.get(tile, 0) + 1
        start += size
    return sum(count > 1 for count in groups_in_tile.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.group_boundaries needs a CUDA GPU")
    rows = []
    for m, n, k, g in SHAPES:
        a = (torch.randn(m, k, device="cuda") * 8).to(torch.float8_e4m3fn)
        a_scales = torch.rand(m, device="cuda") + 0.5
        b = (torch.randn(g, n, k, device="cuda") * 8).to(torch.float8_e4m3fn)
        b_scales = torch.rand(g, n, device="cuda") + 0.5
        tuned = select_config("grouped_mm_2d3d", {"M": m, "N": n, "K": k, "G": g}, DEFAULT_CONFIG)
        flat = helion.Config(**{**tuned.config, "pid_type": "flat"})

        def ours_flat(offs: torch.Tensor) -> torch.Tensor:
            with forced_config("grouped_mm_2d3d", flat):
                return grouped_mm_2d3d(a, a_scales, b, b_scales, offs)

        peers, routing_sizes = {}, routings(m, g)
        for name, sizes in routing_sizes.items():
            offs = offsets(sizes)
            peers[f"ours {name}"] = lambda offs=offs: grouped_mm_2d3d(a, a_scales, b, b_scales, offs)
            peers[f"flat {name}"] = lambda offs=offs: ours_flat(offs)
            peers[f"torch {name}"] = lambda offs=offs: torch._scaled_grouped_mm(
                a, b.transpose(-2, -1), a_scales, b_scales, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        times = bench_peers_us(peers, rounds=len(peers))
        tflops = {name: 2 * m * n * k / us / 1e6 for name, us in times.items()}
        aligned = tflops["ours aligned (equal groups)"]
        for name, sizes in routing_sizes.items():
            ours, theirs = tflops[f"ours {name}"], tflops[f"torch {name}"]
            rows.append([
                f"({m},{n},{k},{g})", name, boundary_tiles(sizes), f"{min(sizes)}-{max(sizes)}",
                ours, tflops[f"flat {name}"], theirs, f"{ours / theirs:.3f}", f"{ours / aligned:.3f}",
            ])
            print(rows[-1], flush=True)
    headers = [
        "shape (M,N,K,G)", "routing", f"row tiles ({ROW_TILE}) with 2+ groups", "group sizes",
        "ours TFLOP/s", "ours, flat grid", "torch fp8 TFLOP/s", "ours / torch", "ours / ours aligned",
    ]
    report = (
        environment_header("Group boundaries inside row tiles: rowwise 2D x 3D grouped GEMM")
        + "\nTFLOP/s = 2*M*N*K / median time; peers in rotating order.\n\n"
        + markdown_table(headers, rows)
    )
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
