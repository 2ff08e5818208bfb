"""Shared benchmark plumbing: timing, the environment header, markdown tables, results as markdown and JSON."""

from __future__ import annotations

import datetime
import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch
import triton.testing

from autotune_cache import library_versions
from autotune_cache.timing import bench_kernel_us  # noqa: F401  (the benchmarks time kernels as the tuner does)

T = TypeVar("T")


def bench_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in microseconds (CUDA events via do_bench; warm-up excluded)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def host_ms(step: Callable[[], object], calls: int = 5) -> float:
    """Median host time of one ``step`` in milliseconds with the GPU never waiting on the host.

    Each timed call is enqueued behind a ``torch.cuda._sleep`` kernel of about a second, so
    the host never waits for the GPU: what it measures is Python, dispatch and launch time,
    the floor under an eager step's time. A step whose host time is above its kernels' time
    runs at its host's speed, and kernel gains do not show in its step time.
    """
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def capture_step(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run once on a side stream (compilation, first launches), then captured in a CUDA graph:
    the graph, and what the captured call returned (its tensors are the ones each replay rewrites).

    A replay repeats the captured kernels on the tensors they used; what ``step`` does on the
    host (Python, allocations, autograd's bookkeeping) is not repeated.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()  # an autograd graph still alive would make the captured backward join the default stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def captured(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (``capture_step``): its replay, free of host time."""
    return capture_step(step)[0].replay


def with_setting(module: object, name: str, value: object, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` run with ``module.name`` set to ``value``, put back after each call: a peer that differs from
    another only by a module-level switch (``token_groups.SPAN_TABLE``, ``grouped_gemm.WORK_ITEM_TABLE``)."""

    def run() -> T:
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, before)

    return run


def bench_peers_us(fns: Mapping[str, Callable[[], object]], rounds: int = 4) -> dict[str, float]:
    """``bench_us`` of each peer, over ``rounds`` rounds that rotate their order: median per peer.

    Under sustained FP8 GEMM load the H200 runs into its 700 W power cap and its SM
    clock falls (1980 MHz idle, 1400-1650 MHz measured under load), so whichever peer is
    timed first after an idle moment runs faster: the same kernel measured 1207 TFLOP/s
    first and 995 four timings later, in one process. A peer's place in a round matters
    too: with four peers in forward-then-reverse rounds, the fourth one ran up to 4% faster
    than the same step timed as the third (Llama 4's grouped linear). Every
    peer is called once before timing (compilation, autotuning); then round ``r`` times
    them all starting from peer ``r mod n`` (with ``rounds`` a multiple of ``n``, each peer
    takes each place equally often), and each peer's median over the rounds is returned.
    """
    names = list(fns)
    for name in names:
        fns[name]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(bench_us(fns[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def profiled(step: Callable[[], object], steps: int, warmup: int = 1, wall_ms: list[float] | None = None):
    """A ``torch.profiler.profile`` of the GPU kernels of ``steps`` calls of ``step``, after ``warmup`` calls
    outside it. ``wall_ms``: a list the profiled steps' GPU wall time (CUDA events around them) is appended to."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    if wall_ms is not None:
        wall_ms.append(start.elapsed_time(end))
    return prof


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now, in MHz (NVML, through ``torch.cuda.clock_rate``); ``None`` where it cannot be
    read (no NVIDIA GPU, no NVML bindings). Under sustained FP8 load the H200's clock falls: a kernel's
    time depends on when it runs."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 (torch raises ModuleNotFoundError, RuntimeError or an NVML error)
        return None


def kernel_table(step: Callable[[], object], steps: int, row_limit: int = 25) -> str:
    """torch.profiler's table of the GPU kernels of ``steps`` calls of ``step`` (after one call outside the
    profile), longest total first, after a line with the wall time of those steps (the GPU is idle for
    the difference between it and the table's "Self CUDA time total") and the SM clock after them."""
    wall_ms: list[float] = []
    prof = profiled(step, steps, wall_ms=wall_ms)
    clock = sm_clock_mhz()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=row_limit, max_name_column_width=60)
    return (
        f"Wall time of the {steps} profiled steps: {wall_ms[0]:.3f}ms (CUDA events around them); "
        f"SM clock after them: {'unknown' if clock is None else f'{clock} MHz'}\n\n{table}"
    )


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e3


# Dirichlet concentration of each random routing: the lower, the more uneven the experts' loads.
DIRICHLET_ROUTINGS = {"skewed": 1.0, "sparse": 0.3}
# The routings whose group sizes are multiples of ``align`` (torch's grouped GEMMs run on them).
ALIGNED_ROUTINGS = ("uniform", *DIRICHLET_ROUTINGS)

# Fine-grained MoE expert GEMMs, (name, M tokens, N, K, G experts): many small experts.
# w1/w3 is the fused gate and up projection (N = 2 x the expert's hidden size), w2 the down one.
# DeepSeek-V3 runs at M = 32768 tokens so that its bf16 and FP8 operands, with their
# gradients, fit one 80 GB H100.
FINE_GRAINED_SHAPES = [
    ("Qwen3-30B-A3B w1/w3", 65536, 1536, 2048, 128),
    ("Qwen3-30B-A3B w2", 65536, 2048, 768, 128),
    ("DeepSeek-V3 w1/w3", 32768, 4096, 7168, 256),
    ("DeepSeek-V3 w2", 32768, 7168, 2048, 256),
]


def routed_group_sizes(total: int, groups: int, routing: str, align: int = 16, seed: int = 0) -> list[int]:
    """Tokens per group (expert) for a benchmark, summing to at most ``total``.

    ``uniform``: equal; ``skewed``: Dirichlet(1) routing; ``sparse``: Dirichlet(0.3)
    routing, uneven enough that some experts get no tokens. These three have sizes that
    are multiples of ``align`` (16 lets torch's grouped GEMMs run), the remainder on the
    largest group. ``unaligned``: odd sizes around ``total / groups`` (ours only), trimmed to fit.
    """
    gen = torch.Generator().manual_seed(seed)
    if routing == "unaligned":
        sizes = [int(s) | 1 for s in torch.randint(total // (2 * groups), 3 * total // (2 * groups), (groups,), generator=gen)]
        while sum(sizes) > total:
            largest = max(range(groups), key=sizes.__getitem__)
            sizes[largest] -= min(sizes[largest], 16)
        return sizes
    if routing == "uniform":
        weights = torch.full((groups,), 1.0 / groups)
    elif routing in DIRICHLET_ROUTINGS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            weights = torch.distributions.Dirichlet(torch.full((groups,), DIRICHLET_ROUTINGS[routing])).sample()
    else:
        raise ValueError(f"routing must be one of {(*ALIGNED_ROUTINGS, 'unaligned')}, got {routing!r}")
    sizes = [int(w * total) // align * align for w in weights]
    sizes[max(range(groups), key=sizes.__getitem__)] += (total - sum(sizes)) // align * align
    return sizes


def offsets(sizes: list[int], device: str = "cuda") -> torch.Tensor:
    """int32 cumulative group ends, as ``torch._grouped_mm`` takes them."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def environment_facts() -> dict[str, str]:
    """The run's date, GPU and torch/triton/helion versions (what ``environment_header`` prints)."""
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        **library_versions(),
    }


def environment_header(title: str) -> str:
    """Markdown header naming the date, GPU and versions."""
    facts = environment_facts()
    versions = ", ".join(f"{name} {version}" for name, version in facts.items() if name not in ("date", "gpu"))
    return (
        f"# {title}\n\n"
        f"- date: {facts['date']}\n"
        f"- GPU: {facts['gpu']}\n"
        f"- {versions}\n"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; floats are printed with 3 significant digits after the point as fits."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def emit_report(report: str, out: Path | None, data: Mapping[str, object] | None = None) -> None:
    """Print ``report`` and, when ``out`` is given, write it there (creating its folder).

    With ``data``, a machine-readable copy goes beside it (``out`` with the suffix
    ``.json``): ``data``'s entries after an ``environment`` entry holding
    ``environment_facts()``, the facts of the markdown header.
    """
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        if data is not None:
            payload = {"environment": environment_facts(), **data}
            out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")


def plot_loss_curves(
    curves: Mapping[str, Sequence[float]],
    path: Path,
    title: str,
    ylabel: str,
    *,
    log_scale: bool = False,
    floor: tuple[float, str] | None = None,
) -> str:
    """Draw loss curves (label -> loss per step) into ``path`` (PNG); a line saying where, or why not.

    ``floor = (value, label)``: a dotted horizontal line (the task's lowest reachable loss).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[demo]')"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=label)
    if floor is not None:
        ax.axhline(floor[0], color="gray", linestyle=":", label=floor[1])
    ax.set(xlabel="step", ylabel=ylabel, title=title, yscale="log" if log_scale else "linear")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"
