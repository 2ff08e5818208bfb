"""Autotune cache benchmark: first-call latency and tuned vs default speed.

    python -m benchmarks.autotune [--out FILE]

1. First call of a kernel on a new shape with the shipped cache (a compile, no
   search) against a cold search (our tuner's space; Helion's quick autotuner).
2. For every shipped cache entry of this architecture: the kernel's default config
   against the tuned one, on the entry's shape.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import kernels_helion  # noqa: F401  (its kernel modules register their tuning)
from autotune_cache import current_arch, forced_config, load_entries
from autotune_cache.registry import tunable_kernels
from benchmarks.common import bench_us, environment_header, markdown_table


def first_call_latency() -> list[list[object]]:
    """Seconds to the first result of ``quantize_rowwise_rows`` on a new shape.

    With the shipped cache it is one compile; without it a user would wait for a
    search: our tuner over the kernel's space, or Helion's own autotuner (quick).
    """
    import helion

    from autotune_cache.tune import tune_shape
    from kernels_helion.quantize_rowwise import quantize_rowwise_rows_args, quantize_rowwise_rows_kernel

    spec = tunable_kernels()["quantize_rowwise_rows"]
    shape = {"M": 32768, "K": 6144}  # not a tuned shape: nothing compiled for it yet
    call = spec.make_call(shape, torch.device("cuda"))
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    cached_s = time.perf_counter() - start

    start = time.perf_counter()
    tune_shape(spec, shape, current_arch(), deadline=time.monotonic() + 600)
    space_s = time.perf_counter() - start

    x = torch.randn(shape["M"], shape["K"], device="cuda", dtype=torch.bfloat16)
    args = quantize_rowwise_rows_args(x)
    fresh = helion.kernel(quantize_rowwise_rows_kernel.fn, static_shapes=False, autotune_effort="quick")
    os.environ["HELION_SKIP_CACHE"] = "1"  # a cold search: no result from an earlier run's on-disk cache
    try:
        start = time.perf_counter()
        fresh(*args)
        torch.cuda.synchronize()
        helion_s = time.perf_counter() - start
    finally:
        del os.environ["HELION_SKIP_CACHE"]
    return [["quantize_rowwise_rows", str(shape), round(cached_s, 2), round(space_s, 1), round(helion_s, 1)]]


def tuned_vs_default(max_shapes: int) -> list[list[object]]:
    rows: list[list[object]] = []
    arch = current_arch()
    for name, spec in tunable_kernels().items():
        entries = load_entries(arch, name)
        for shape in list(spec.shapes)[:max_shapes]:
            call = spec.make_call(shape, torch.device("cuda"))
            with forced_config(name, spec.default_config):
                default_us = bench_us(call)
            tuned_us = bench_us(call)  # the normal path: select_config picks the cached entry
            rows.append([name, str(shape), default_us, tuned_us, default_us / tuned_us, len(entries)])
            del call
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-shapes", type=int, default=2, help="tuning shapes per kernel to compare")
    args = parser.parse_args()
    report = environment_header("Autotune cache: first-call latency and tuned vs default")
    report += "\n## First call (seconds)\n\n" + markdown_table(
        ["kernel", "shape", "with cache (compile only)", "our tuner's search", "Helion search (quick)"],
        first_call_latency(),
    )
    report += "\n## Tuned vs default config (us)\n\n" + markdown_table(
        ["kernel", "shape", "default", "tuned", "speedup", "cache entries"], tuned_vs_default(args.max_shapes)
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
