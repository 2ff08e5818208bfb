"""The FP8 wgrad adding into a bf16 gradient, prefetching the gradient's tile of a later program too.

    python -m benchmarks.wgrad_prefetch_ahead [--shapes NAME ...] [--waves W ...] [--out FILE]

At a few hundred rows a group, ``grouped_mm_wgrad`` adding into ``.grad`` is bound by the
gradient's read-modify-write, not by its MMAs. Each program asks L2 for its own tile before its
contraction; with ``prefetch_waves = W`` it also asks for the tile ``W * SMs`` tiles after its
own in the tile order (a later wave's, or a persistent program's own next tile), so that the
gradient's DRAM reads are in flight a whole tile's time before they are needed. Each shape runs
the shipped ``ACC: 1`` config and the default persistent one, each with every ``W`` (0: today's
kernel), in rotating order (``bench_peers_us``), all adding into one gradient; a row gives the
time, the gradient's read and write as a share of copy bandwidth, and whether its result equals
``W = 0``'s bits (the prefetch changes no arithmetic).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import bench_peers_us, copy_bandwidth_gbs, emit_report, environment_header, markdown_table
from kernels_helion import grouped_gemm_wgrad
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from kernels_helion.tuning import fp8_operands, routed_offsets

import helion  # noqa: E402  (after kernels_helion, which sets up helion for this torch)
from autotune_cache import select_config  # noqa: E402

# name -> (M pairs, N, K, G): the layer's accumulating wgrads (w1 and w3 as one GEMM).
SHAPES = {
    "dsv3-256-w13": (65536, 4096, 7168, 256),
    "dsv3-256-w2": (65536, 7168, 2048, 256),
    "qwen3-32k-w13": (262144, 1536, 2048, 128),
    "qwen3-32k-w2": (262144, 2048, 768, 128),
}


def run_shape(name: str, waves: list[int], copy_gbs: float) -> list[dict[str, object]]:
    m, n, k, g = SHAPES[name]
    columns = padded_token_count(m, g, WGRAD_GROUP_ALIGNMENT)
    a_t, _ = fp8_operands(n, columns, device="cuda")
    b_t, _ = fp8_operands(k, columns, device="cuda")
    a_scales = torch.rand(g, n, device="cuda") + 0.5
    b_scales = torch.rand(g, k, device="cuda") + 0.5
    offs = routed_offsets(m, g, "cuda")
    key = {"M": columns, "N": n, "K": k, "G": g}
    bases = {
        "ACC entry": select_config("grouped_mm_wgrad", {**key, "ACC": 1}, grouped_gemm_wgrad.DEFAULT_CONFIG),
        "default": grouped_gemm_wgrad.DEFAULT_CONFIG,
    }
    configs = {
        f"{base} W={w}": helion.Config(**{**config.config, "prefetch_waves": w})
        for base, config in bases.items() for w in waves
    }
    original = grouped_gemm_wgrad._select_config

    def call(config: helion.Config, out: torch.Tensor):  # noqa: ANN202
        def run() -> torch.Tensor:
            grouped_gemm_wgrad._select_config = lambda *_: config
            try:
                return grouped_gemm_wgrad.grouped_mm_wgrad(
                    a_t, a_scales, b_t, b_scales, offs, out=out, group_alignment=WGRAD_GROUP_ALIGNMENT)
            finally:
                grouped_gemm_wgrad._select_config = original
        return run

    grad = torch.zeros(g, n, k, device="cuda", dtype=torch.bfloat16)
    reference = {}
    for base in bases:
        grad.zero_()
        call(configs[f"{base} W=0"], grad)()
        reference[base] = grad.clone()
    same = {}
    for label, config in configs.items():
        grad.zero_()
        call(config, grad)()
        same[label] = torch.equal(grad, reference[label.split(" W=")[0]])
    reference.clear()
    times = bench_peers_us({label: call(config, grad) for label, config in configs.items()})
    grad_bytes = 2 * grad.numel() * grad.element_size()
    rows = []
    for label, us in times.items():
        base, w = label.split(" W=")
        rows.append({
            "shape": name, "config": base, "waves": int(w), "us": us,
            "speedup": times[f"{base} W=0"] / us, "copy_share": grad_bytes / us / 1e3 / copy_gbs,
            "bitwise": same[label], "kernel_config": dict(configs[label].config),
        })
        print(rows[-1], flush=True)
    del grad
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--waves", nargs="*", type=int, default=[0, 1, 2, 4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    waves = sorted({0, *args.waves})
    copy_gbs = copy_bandwidth_gbs()
    rows = [row for name in args.shapes for row in run_shape(name, waves, copy_gbs)]
    command = "python -m benchmarks.wgrad_prefetch_ahead " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown_table(
        ["shape (M, N, K, G)", "config", "waves ahead", "us", "vs W=0", "gradient RMW / copy BW", "same bits"],
        [[f"{r['shape']} {SHAPES[r['shape']]}", r["config"], r["waves"], r["us"], r["speedup"],
          f"{100 * r['copy_share']:.0f}%", r["bitwise"]] for r in rows],
    )
    report = environment_header("FP8 wgrad into .grad: L2 prefetch of a later program's gradient tile") + (
        f"- command: `{command.strip()}`\n- copy bandwidth: {copy_gbs:.0f} GB/s\n\n{table}"
    )
    emit_report(report, args.out, {"command": command.strip(), "copy_gbs": copy_gbs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
