"""GPU time of a call's kernels, without host overhead: how the tuner and the benchmarks time kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch


def bench_kernel_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """GPU time of ``fn``'s kernels in microseconds, without host overhead, from a cold L2.

    ``bench_us`` times eager calls, so a call whose host side (Python, launches)
    takes longer than its kernels measures the host. Here ``calls`` calls are
    captured in a CUDA graph, each after an L2 flush (a 256 MiB memset), and the
    same graph of flushes alone is subtracted: median over ``replays`` replays.
    Kernel bandwidth is measured this way; host time by ``benchmarks.host_overhead``.
    """
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()

    def graph_of(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        return graph

    def flush_only() -> None:
        flush.zero_()

    def flush_and_call() -> None:
        flush.zero_()
        fn()

    def median_ms(graph: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    with_calls, flushes = graph_of(flush_and_call), graph_of(flush_only)
    return max(median_ms(with_calls) - median_ms(flushes), 0.0) * 1e3 / calls
