"""Host (CPU) time of one FP8 grouped linear forward+backward, where the GPU work is negligible.

    python -m benchmarks.host_overhead [--recipe rowwise]

At a tiny shape the step time is the time Python takes to enqueue the kernels:
the floor under which small MoE layers cannot go in eager mode. Printed next to
bf16 ``torch._grouped_mm``'s, and per launcher call (with the direct kernel launch of
``kernels_helion._launch`` and through Triton's ``run``, in the same process: host
speed differs between machines, so compare numbers from one run).

Step times in three modes, alternated over three rounds (medians): the backward
on autograd's device thread (PyTorch's default for CUDA), on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``), and on the device thread
with the main thread and the device thread pinned to one CPU core. Linux only
(``os.sched_setaffinity``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
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


class BackwardThreadCores:
    """A gradient hook that moves the thread running the backward (autograd's device thread) to ``cores``."""

    def __init__(self) -> None:
        self.main_thread = threading.get_native_id()
        self.cores: set[int] = os.sched_getaffinity(0)
        self.applied: set[int] | None = None  # what the device thread was last given

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if threading.get_native_id() != self.main_thread and self.applied != self.cores:
            os.sched_setaffinity(0, self.cores)  # Linux: pid 0 is the calling thread
            self.applied = set(self.cores)
        return grad


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

    all_cores = os.sched_getaffinity(0)
    one_core = sorted(all_cores)[len(all_cores) // 2]
    backward_cores = BackwardThreadCores()
    # mode -> (backward on autograd's device thread, the main thread's cores, the device thread's,
    # whether to time Triton's run launching the kernels too)
    modes = {
        "the device thread (default)": (True, all_cores, all_cores, True),
        "the calling thread": (False, all_cores, all_cores, True),
        f"the device thread, both threads pinned to core {one_core}": (True, {one_core}, {one_core}, False),
    }

    def hooked(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = fn()
            out.register_hook(backward_cores)
            return out

        return run

    bf16_fn = hooked(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    ours_fn = hooked(lambda: ops.fp8_grouped_linear(x, w, offs, recipe=recipe))
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    # Rounds alternate the modes: the host's speed drifts within a run.
    for _ in range(3):
        for mode, (device_thread, main_cores, device_thread_cores, time_triton_run) in modes.items():
            torch.autograd.set_multithreading_enabled(device_thread)
            os.sched_setaffinity(0, main_cores)
            backward_cores.cores = device_thread_cores
            times[mode].setdefault("bf16", []).append(host_us(step(bf16_fn)))
            times[mode].setdefault("ours", []).append(host_us(step(ours_fn)))
            if time_triton_run:
                with mock.patch.object(launch_module, "_launch_hooks_active", lambda: True):
                    times[mode].setdefault("triton", []).append(host_us(step(ours_fn)))
    torch.autograd.set_multithreading_enabled(True)
    os.sched_setaffinity(0, all_cores)
    for mode, peers in times.items():
        triton_note = (
            f" ({statistics.median(peers['triton']):.0f} us with Triton's run launching the kernels)"
            if "triton" in peers else ""
        )
        print(
            f"fwd+bwd host time per step at {m}x{n}x{k}, G={g}, backward on {mode}: "
            f"bf16 {statistics.median(peers['bf16']):.0f} us, ours ({args.recipe}) "
            f"{statistics.median(peers['ours']):.0f} us{triton_note}; ours per round "
            f"{[round(t) for t in peers['ours']]}"
        )
    direct = host_us(lambda: kernels.quantize_rowwise_rows(grad_out))
    # The same call with Triton's run doing the launch (as when a launch hook is installed):
    # what the direct launch saves, measured in this process (host speed varies between machines).
    with mock.patch.object(launch_module, "_launch_hooks_active", lambda: True):
        through_triton = host_us(lambda: kernels.quantize_rowwise_rows(grad_out))
    print(
        f"one launcher call (quantize_rowwise_rows): {direct:.0f} us "
        f"({through_triton:.0f} us when Triton's run launches the kernel)"
    )


if __name__ == "__main__":
    main()
