"""Shared benchmark plumbing: timing, the environment header, markdown tables."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import triton.testing

from autotune_cache import library_versions


def bench_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in microseconds (CUDA events via do_bench; warm-up excluded)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e3


def environment_header(title: str) -> str:
    """Markdown header naming the date, GPU and versions."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = ", ".join(f"{name} {version}" for name, version in library_versions().items())
    return (
        f"# {title}\n\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- GPU: {gpu}\n"
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
