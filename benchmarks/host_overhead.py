"""Host (CPU) time of one FP8 grouped linear forward+backward, where the GPU work is negligible.

    python -m benchmarks.host_overhead [--recipe rowwise]

At a tiny shape the step time is the time Python takes to enqueue the kernels:
the floor under which small MoE layers cannot go in eager mode. Printed next to
bf16 ``torch._grouped_mm``'s, and per launcher call (with the direct kernel launch of
``kernels_helion._launch`` and through Triton's ``run``, in the same process: host
speed differs between machines, so compare numbers from one run).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from unittest import mock

import torch

import kernels_helion as kernels
import kernels_helion._launch as launch_module
import ops


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Mean wall time of ``fn`` in microseconds, after warm-up (the GPU never falls behind here)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="rowwise")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.host_overhead needs a CUDA GPU")
    m, n, k, g = 256, 256, 256, 4
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32, device="cuda")
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    recipe = ops.Fp8Recipe(name=args.recipe)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            x.grad = w.grad = None
            fn().backward(grad_out)

        return run

    for threads in ("device thread (default)", "calling thread"):
        # PyTorch runs a CUDA backward on its autograd device thread, where our Python
        # backward measured about 2x slower than on the calling thread.
        torch.autograd.set_multithreading_enabled(threads.startswith("device"))
        bf16 = host_us(step(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)))
        ours = host_us(step(lambda: ops.fp8_grouped_linear(x, w, offs, recipe=recipe)))
        with mock.patch.object(launch_module, "_launch_hooks_active", lambda: True):
            ours_triton = host_us(step(lambda: ops.fp8_grouped_linear(x, w, offs, recipe=recipe)))
        print(
            f"fwd+bwd host time per step at {m}x{n}x{k}, G={g}, backward on the {threads}: "
            f"bf16 {bf16:.0f} us, ours ({args.recipe}) {ours:.0f} us "
            f"({ours_triton:.0f} us with Triton's run launching the kernels)"
        )
    torch.autograd.set_multithreading_enabled(True)
    direct = host_us(lambda: kernels.quantize_rowwise(grad_out))
    # The same call with Triton's run doing the launch (as when a launch hook is installed):
    # what the direct launch saves, measured in this process (host speed varies between machines).
    with mock.patch.object(launch_module, "_launch_hooks_active", lambda: True):
        through_triton = host_us(lambda: kernels.quantize_rowwise(grad_out))
    print(
        f"one launcher call (quantize_rowwise): {direct:.0f} us "
        f"({through_triton:.0f} us when Triton's run launches the kernel)"
    )


if __name__ == "__main__":
    main()
