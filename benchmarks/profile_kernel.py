"""Call one tunable kernel a few times, for a profiler such as Nsight Compute.

    ncu -k regex:activation_rows_and_cols_cast --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m benchmarks.profile_kernel quantize_rowwise_rows_and_cols_grouped_cast M=32768,K=7168,G=8

The call is the tuner's for that kernel and shape (``autotune_cache.registry``, filled by the kernel modules):
the same inputs through the same public launcher, so the cached config runs.
Kernel names and shape sizes are those of ``python -m kernels_helion.tune``; the
first call compiles, so skip it in the profiler. The per-kernel numbers in
``benchmarks/results/ncu_quantizers_h200.md`` come from this command.
"""

from __future__ import annotations

import argparse

import torch

import kernels_helion  # noqa: F401  (its kernel modules register their tuning)
from autotune_cache.registry import tunable_kernels
from autotune_cache.tune import parse_shape_filter


def main(argv: list[str] | None = None) -> int:
    specs = tunable_kernels()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=sorted(specs), metavar="KERNEL", help="a tunable kernel's name")
    parser.add_argument("shape", type=parse_shape_filter, help="its sizes, e.g. M=32768,K=7168,G=8")
    parser.add_argument("--calls", type=int, default=3, help="calls to make (default 3; the first compiles)")
    args = parser.parse_args(argv)
    spec = specs[args.kernel]
    missing = sorted(set(spec.shapes[0]) - set(args.shape))
    if missing:
        parser.error(f"{args.kernel} needs the sizes {sorted(spec.shapes[0])}; missing {missing}")
    if not torch.cuda.is_available():
        parser.error("profiling needs a GPU")
    call = spec.make_call(args.shape, torch.device("cuda"))
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{args.kernel} {args.shape}: {args.calls} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
