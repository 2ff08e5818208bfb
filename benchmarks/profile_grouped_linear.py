"""Where the time of one FP8 grouped linear (forward + backward) goes, kernel by kernel.

    python -m benchmarks.profile_grouped_linear [--shape M N K G | --fine-grained] [--routing uniform|skewed|sparse]
                                                [--recipe rowwise] [--unfolded] [--micro-batches N] [--out FILE]

Runs the op a few times under ``torch.profiler`` (after a warm-up that compiles
everything) and prints each GPU kernel's average time per step, next to bf16
``torch._grouped_mm``'s, so that the kernel to work on is obvious. With
``--micro-batches N`` ours runs N steps per ``ops.reuse_quantized_weights()`` block
(gradient accumulation: the weight is quantized by the first step only), and its
times and calls are per step. ``--fine-grained`` profiles each fine-grained MoE shape
(``benchmarks.common.FINE_GRAINED_SHAPES``: Qwen3-30B-A3B, DeepSeek-V3) in turn, one
report section per shape; ``--routing sparse`` is Dirichlet(0.3) routing, some experts
getting no tokens.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

import ops
from benchmarks.common import (
    ALIGNED_ROUTINGS,
    FINE_GRAINED_SHAPES,
    emit_report,
    environment_header,
    markdown_table,
    offsets,
    profiled,
    routed_group_sizes,
)

STEPS = 5


def kernel_times_us(step, steps: int = STEPS) -> tuple[list[tuple[str, float, int]], float]:
    """``([(kernel name, us per step, calls per step)], total GPU us per step)`` of ``step()``."""
    rows = []
    for event in profiled(step, steps, warmup=3).key_averages():
        gpu_us = event.device_time_total
        if gpu_us > 0 and event.count > 0:
            rows.append((event.key[:90], gpu_us / steps, event.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def profile_shape(shape: tuple[int, int, int, int], routing: str, recipe: ops.Fp8Recipe, micro_batches: int) -> str:
    """Markdown sections, bf16's then ours, of the GPU kernels of one fwd+bwd step of ``shape`` (M, N, K, G)."""
    m, n, k, g = shape
    offs = offsets(routed_group_sizes(m, g, routing))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device="cuda") * k**-0.5).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def run(fn, micro_batches: int = 1):
        def step():
            reuse = ops.reuse_quantized_weights() if micro_batches > 1 else contextlib.nullcontext()
            with reuse:
                for _ in range(micro_batches):
                    x.grad = w.grad = None
                    fn().backward(grad_out)

        return step

    sections = ""
    for name, fn, batches in (
        ("bf16", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), 1),
        ("ours", lambda: ops.fp8_grouped_linear(x, w, offs, recipe=recipe), micro_batches),
    ):
        rows, total = kernel_times_us(run(fn, batches))
        total /= batches
        table = [[kname, us / batches, calls / batches, 100 * us / batches / total] for kname, us, calls in rows]
        sections += f"\n## {name}: {total:.0f} us of GPU kernels per step\n\n"
        sections += markdown_table(["kernel", "us/step", "calls/step", "%"], table) + "\n"
    return sections


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape_set = parser.add_mutually_exclusive_group()
    shape_set.add_argument("--shape", type=int, nargs=4, default=[32768, 1536, 2048, 16], metavar=("M", "N", "K", "G"))
    shape_set.add_argument(
        "--fine-grained", action="store_true", help="profile each fine-grained MoE shape (128 and 256 experts) in turn"
    )
    parser.add_argument("--routing", default="uniform", choices=ALIGNED_ROUTINGS)
    parser.add_argument("--recipe", default="rowwise")
    parser.add_argument("--unfolded", action="store_true", help="rowwise: RowwiseOptions(fold_dgrad_weight_scales=False)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        metavar="N",
        help="ours: N steps per ops.reuse_quantized_weights() block; times per step",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.micro_batches < 1:
        parser.error("--micro-batches must be >= 1")
    if args.unfolded and args.recipe != "rowwise":
        parser.error("--unfolded applies to --recipe rowwise")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.profile_grouped_linear needs a CUDA GPU")
    options = ops.RowwiseOptions(fold_dgrad_weight_scales=False) if args.unfolded else None
    recipe = ops.Fp8Recipe(name=args.recipe, options=options)
    if args.fine_grained:
        shapes = [(f"{name} ", tuple(dims)) for name, *dims in FINE_GRAINED_SHAPES]
    else:
        shapes = [("", tuple(args.shape))]

    unfolded = ", dgrad weight scales not folded" if args.unfolded else ""
    reused = f", {args.micro_batches} micro-batches per weight quantization" if args.micro_batches > 1 else ""
    report = ""
    for label, (m, n, k, g) in shapes:
        report += environment_header(
            f"Profile: grouped linear fwd+bwd, {label}{m}x{n}x{k} G={g} {args.routing}, {args.recipe}{unfolded}{reused}"
        )
        report += profile_shape((m, n, k, g), args.routing, recipe, args.micro_batches)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
