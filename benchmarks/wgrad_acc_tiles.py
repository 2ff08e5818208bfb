"""The FP8 wgrad adding into a bf16 gradient at DeepSeek-V3-like 256 experts: the shipped ``ACC: 1``
entry against smaller tiles, other grids and TMA loads of the token tiles.

    python -m benchmarks.wgrad_acc_tiles --run 1|2

The kernel is bound by the gradient's read-modify-write and runs two 4-warp programs an SM (254
registers a thread). Run 1 tries tiles that hold fewer registers (so that more programs fit), run 2
the TMA loads that looked faster in run 1 with the persistent tiles. Peers in rotating order
(``bench_peers_us``), all adding into one gradient; ``same`` compares each config's gradient, from
zero, with the entry's.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import bench_peers_us, copy_bandwidth_gbs
from kernels_helion import grouped_gemm_wgrad
from kernels_helion._launch import with_tma
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from kernels_helion.tuning import fp8_operands, routed_offsets

import helion  # noqa: E402  (after kernels_helion)
from autotune_cache import select_config  # noqa: E402

FLAT, PERSISTENT = "flat", "persistent_interleaved"
RUNS = {
    1: {
        "k128n64 4w3s flat": ([128, 64], 4, 3, FLAT, 1),
        "k64n128 4w3s flat": ([64, 128], 4, 3, FLAT, 1),
        "k128n64 4w4s flat": ([128, 64], 4, 4, FLAT, 1),
        "k64n128 4w4s flat": ([64, 128], 4, 4, FLAT, 1),
        "k128n64 4w3s pers4": ([128, 64], 4, 3, PERSISTENT, 4),
        "k128n128 8w3s flat": ([128, 128], 8, 3, FLAT, 1),
        "k256n64 4w3s flat": ([256, 64], 4, 3, FLAT, 1),
        "k128n128 4w2s flat": ([128, 128], 4, 2, FLAT, 1),
        "TMA k128n128 4w3s flat": ([128, 128], 4, 3, FLAT, 1),
        "TMA k128n64 4w3s flat": ([128, 64], 4, 3, FLAT, 1),
    },
    2: {
        "TMA k128n128 4w3s flat": ([128, 128], 4, 3, FLAT, 1),
        "TMA k256n128 8w5s pers": ([256, 128], 8, 5, PERSISTENT, 1),
        "TMA k256n128 8w4s pers": ([256, 128], 8, 4, PERSISTENT, 1),
        "TMA k128n128 4w3s pers2": ([128, 128], 4, 3, PERSISTENT, 2),
    },
}


def config(blocks: list[int], warps: int, stages: int, pid_type: str, per_sm: int) -> helion.Config:
    extra = {"num_sm_multiplier": per_sm} if per_sm > 1 else {}
    return helion.Config(block_sizes=blocks, num_warps=warps, num_stages=stages, pid_type=pid_type,
                         l2_groupings=[8], block_t=128, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=int, choices=list(RUNS), default=1)
    args = parser.parse_args(argv)
    copy = copy_bandwidth_gbs()
    print("copy GB/s", copy)
    for m, n, k, g in [(65536, 4096, 7168, 256), (65536, 7168, 2048, 256)]:
        columns = padded_token_count(m, g, WGRAD_GROUP_ALIGNMENT)
        a_t, _ = fp8_operands(n, columns, device="cuda")
        b_t, _ = fp8_operands(k, columns, device="cuda")
        sa = torch.rand(g, n, device="cuda") + 0.5
        sb = torch.rand(g, k, device="cuda") + 0.5
        offs = routed_offsets(m, g, "cuda")
        key = {"M": columns, "N": n, "K": k, "G": g, "ACC": 1}
        configs = {"ACC entry": select_config("grouped_mm_wgrad", key, grouped_gemm_wgrad.DEFAULT_CONFIG)}
        configs.update({name: config(*c) for name, c in RUNS[args.run].items()})
        tma = {id(c) for name, c in configs.items() if name.startswith("TMA")}
        select, tma_config = grouped_gemm_wgrad._select_config, grouped_gemm_wgrad.tma_config

        def tma_loads(kernel, kernel_args, cfg, out, accumulate):  # noqa: ANN001, ANN202
            return with_tma(kernel, kernel_args, cfg, loads=("a_token_tiles", "b_token_tiles"))

        def call(cfg: helion.Config, out: torch.Tensor):  # noqa: ANN202
            def run() -> torch.Tensor:
                grouped_gemm_wgrad._select_config = lambda *_: cfg
                grouped_gemm_wgrad.tma_config = tma_loads if id(cfg) in tma else tma_config
                try:
                    return grouped_gemm_wgrad.grouped_mm_wgrad(
                        a_t, sa, b_t, sb, offs, out=out, group_alignment=WGRAD_GROUP_ALIGNMENT)
                finally:
                    grouped_gemm_wgrad._select_config, grouped_gemm_wgrad.tma_config = select, tma_config
            return run

        grad = torch.zeros(g, n, k, device="cuda", dtype=torch.bfloat16)
        call(configs["ACC entry"], grad)()
        reference = grad.clone()
        same = {}
        for name, cfg in configs.items():
            grad.zero_()
            call(cfg, grad)()
            same[name] = torch.equal(grad, reference)
        del reference
        times = bench_peers_us({name: call(cfg, grad) for name, cfg in configs.items()})
        rmw_bytes = 2 * grad.numel() * grad.element_size()
        for name, us in times.items():
            print(f"{(m, n, k, g)} {name:22s} {us:9.0f} us  {times['ACC entry'] / us:.3f}x  "
                  f"{100 * rmw_bytes / us / 1e3 / copy:.0f}% copy  same={same[name]}", flush=True)
        del grad
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
