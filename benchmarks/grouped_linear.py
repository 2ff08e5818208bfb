"""Forward + backward of one MoE grouped linear: ours (an FP8 recipe) vs bf16 vs an FP8 path made of PyTorch ops.

    python -m benchmarks.grouped_linear [--recipe rowwise|blockwise|mxfp8] [--quick | --shape M N K G | --fine-grained]
        [--single-thread-autograd] [--cuda-graph] [--unfolded-peer] [--control-peer]
        [--micro-batches N] [--out FILE.md]

Peers, timed in the same process on the same inputs:
- ``bf16``: ``torch._grouped_mm`` and its autograd;
- ``torch fp8``: rowwise quantization written in PyTorch (eager) +
  ``torch._scaled_grouped_mm`` for forward, dgrad and wgrad (what one builds
  from PyTorch alone, as torchao's rowwise recipe does);
- ``ours``: ``ops.fp8_grouped_linear`` with ``--recipe`` (default ``rowwise``;
  ``blockwise``: DeepSeek-V3's 1x128 / 128x128 scales; ``mxfp8``: OCP MXFP8, GEMMs
  emulated on Hopper, so slower than bf16 there).
Each is checked against bf16 (SQNR of out, dx, dw) before timing; the peers are then
timed round-robin in rotating order (``benchmarks.common.bench_peers_us``). Group sizes:
uniform, and skewed (Dirichlet(1) routing), rounded to multiples of 16. ``--fine-grained``
runs the fine-grained MoE shapes (Qwen3-30B-A3B, DeepSeek-V3: 128 and 256 experts,
``benchmarks.common.FINE_GRAINED_SHAPES``) in place of the default set, routed uniform,
skewed and sparse (Dirichlet(0.3): some experts get no tokens). ``--cuda-graph``
captures each peer's step in a CUDA graph and times its replays: GPU time without the
host's (what a captured training step or ``torch.compile(mode="reduce-overhead")`` reaches).
``--micro-batches N`` adds ``ours reused``: N steps in one ``ops.reuse_quantized_weights()``
block (gradient accumulation: the weight quantized by the first step only), timed per step.
``--out FILE.md`` writes the markdown report and, beside it, ``FILE.json``: the same rows
(one object per row, keyed by the table's headers, plus the shape's M, N, K, G), the
command, its options, and the date, GPU and versions of the header.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

import ops
from benchmarks.common import (
    ALIGNED_ROUTINGS,
    FINE_GRAINED_SHAPES,
    bench_peers_us,
    captured,
    emit_report,
    environment_header,
    markdown_table,
    offsets,
    routed_group_sizes,
)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max

# (M, N, K, G): tokens, output features, input features, experts.
SHAPES = [
    (32768, 8192, 5120, 4),
    (32768, 2048, 7168, 8),
    (32768, 7168, 2048, 8),
    (32768, 1536, 2048, 16),
    (65536, 2048, 7168, 32),
]
QUICK_SHAPES = [SHAPES[1], SHAPES[4]]
ROUTINGS = ("uniform", "skewed")


# --- the FP8 path made of PyTorch ops -----------------------------------------------


def _quantize(t: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    scale = amax.float().clamp(min=1e-12) / E4M3_MAX
    # One float32 copy, scaled and clamped in place: a DeepSeek-V3 expert weight (256 x 4096 x 7168)
    # takes 30 GB in float32, and two such temporaries would not fit one 80 GB GPU beside the weight
    # and the reference's gradient.
    return t.to(torch.float32, copy=True).div_(scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _rowwise(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Quantize with one scale per slice reduced along ``dim``; scales have ``dim`` squeezed."""
    q, scale = _quantize(t, t.abs().amax(dim=dim, keepdim=True))
    return q, scale.squeeze(dim)


def _rowwise_cols_grouped_t(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """``(M, C)`` -> tokens-contiguous fp8 ``(C, M)`` and ``(G * C,)`` scales per (group, column)."""
    m, c = t.shape
    groups = offs.shape[0]
    group_of_row = torch.searchsorted(offs, torch.arange(m, device=t.device, dtype=torch.int32), right=True)
    amax = torch.zeros(groups + 1, c, device=t.device)
    amax.scatter_reduce_(0, group_of_row[:, None].expand(m, c), t.abs().float(), "amax")
    q, scale = _quantize(t, amax[group_of_row])
    groups_scale = (amax[:groups].clamp(min=1e-12) / E4M3_MAX).reshape(-1)
    return q.t().contiguous(), groups_scale


class TorchFp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        x_fp8, x_s = _rowwise(x, 1)
        w_fp8, w_s = _rowwise(w, 2)
        ctx.save_for_backward(x, w, offs)
        return torch._scaled_grouped_mm(
            x_fp8, w_fp8.transpose(-2, -1), x_s, w_s, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w, offs = ctx.saved_tensors
        go_fp8, go_s = _rowwise(grad_out, 1)
        # W quantized along N for dgrad, laid out (E, K, N) so that its (E, N, K) view is column-major.
        wt_fp8, wt_s = _rowwise(w.transpose(-2, -1), 2)
        dx = torch._scaled_grouped_mm(
            go_fp8, wt_fp8.contiguous().transpose(-2, -1), go_s, wt_s, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True,
        )
        got_fp8, got_s = _rowwise_cols_grouped_t(grad_out, offs)
        xt_fp8, xt_s = _rowwise_cols_grouped_t(x, offs)
        dw = torch._scaled_grouped_mm(
            got_fp8, xt_fp8.t(), got_s, xt_s, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )
        return dx, dw, None


# --- the benchmark ----------------------------------------------------------------


def bf16_linear(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def methods(recipe: ops.Fp8Recipe, unfolded_peer: bool = False, control_peer: bool = False) -> dict[str, object]:
    """The peers, bf16 (the reference) first.

    ``unfolded_peer`` adds ``recipe`` with dgrad's weight quantized along N;
    ``control_peer`` adds ``ours`` again, last: its ratio to ``ours`` is the timing's spread.
    """
    peers = {
        "bf16": bf16_linear,
        "torch fp8": TorchFp8GroupedLinear.apply,
        "ours": functools.partial(ops.fp8_grouped_linear, recipe=recipe),
    }
    if unfolded_peer:
        unfolded = dataclasses.replace(recipe, options=dataclasses.replace(recipe.options, fold_dgrad_weight_scales=False))
        peers["ours unfolded"] = functools.partial(ops.fp8_grouped_linear, recipe=unfolded)
    if control_peer:
        peers["ours again"] = peers["ours"]
    return peers


def sqnr_db(actual: Tensor, reference: Tensor, chunk: int = 1 << 26) -> float:
    """Signal-to-quantization-noise ratio in dB, summed over chunks of ``chunk`` elements: a float32
    copy of a fine-grained model's whole weight gradient would not fit beside the benchmark's tensors."""
    noise = signal = 0.0
    for a, r in zip(actual.reshape(-1).split(chunk), reference.reshape(-1).split(chunk)):
        r = r.float()
        noise += float((a.float() - r).square().sum())
        signal += float(r.square().sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def measure(
    shape: tuple[int, int, int, int],
    routing: str,
    recipe: ops.Fp8Recipe,
    cuda_graph: bool = False,
    unfolded_peer: bool = False,
    control_peer: bool = False,
    micro_batch_count: int = 0,
) -> dict[str, object]:
    m, n, k, g = shape
    sizes = routed_group_sizes(m, g, routing)
    offs = offsets(sizes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device="cuda") * k**-0.5).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(fn):
        # Fresh gradients each call: accumulation would add a pass over x and w.
        x.grad = w.grad = None
        out = fn(x, w, offs)
        out.backward(grad_out)
        return out

    def micro_batches(fn):
        # One block of steps, as between two optimizer steps: the last step's result is checked.
        with ops.reuse_quantized_weights():
            for _ in range(micro_batch_count):
                out = fwd_bwd(fn)
        return out

    results: dict[str, object] = {"shape": shape, "routing": routing, "max_group": max(sizes)}
    reference = None
    peers = methods(recipe, unfolded_peer, control_peer)
    steps = {name: functools.partial(fwd_bwd, fn) for name, fn in peers.items()}
    if micro_batch_count:
        steps["ours reused"] = functools.partial(micro_batches, peers["ours"])
    for name, step in steps.items():
        out = step()
        grads = (out.detach(), x.grad, w.grad)
        if reference is None:
            reference = grads
        else:
            results[f"{name} sqnr"] = min(sqnr_db(a, r) for a, r in zip(grads, reference))
        # Only the reference's gradients stay: the next step drops x.grad and w.grad before it runs.
        del grads, out
    del reference
    if cuda_graph:
        steps = {name: captured(step) for name, step in steps.items()}
    times = bench_peers_us(steps)
    if micro_batch_count:
        times["ours reused"] /= micro_batch_count
    results.update({name: us / 1e3 for name, us in times.items()})
    x.grad = w.grad = None
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="rowwise", choices=ops.registered_recipes(), help="our FP8 recipe")
    shape_set = parser.add_mutually_exclusive_group()
    shape_set.add_argument("--quick", action="store_true", help="two shapes only")
    shape_set.add_argument("--shape", type=int, nargs=4, metavar=("M", "N", "K", "G"), help="one shape instead of the set")
    shape_set.add_argument(
        "--fine-grained",
        action="store_true",
        help="the fine-grained MoE shapes (128 and 256 experts) instead of the set, routings uniform, skewed and sparse",
    )
    parser.add_argument(
        "--single-thread-autograd",
        action="store_true",
        help="torch.autograd.set_multithreading_enabled(False): backward runs on the calling thread "
        "(less host time per step for every peer)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time each peer's fwd+bwd captured in a CUDA graph (GPU time only, no host time)",
    )
    parser.add_argument(
        "--unfolded-peer",
        action="store_true",
        help="rowwise: also time the recipe with fold_dgrad_weight_scales=False, as a fourth peer",
    )
    parser.add_argument(
        "--control-peer",
        action="store_true",
        help="also time ours a second time, as the last peer: the two times' ratio shows the timing's spread",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        metavar="N",
        help="also time ours as N steps in one ops.reuse_quantized_weights() block (gradient accumulation), per step",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here (JSON beside it)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.micro_batches < 0:
        parser.error("--micro-batches must be >= 0")
    if args.unfolded_peer and args.recipe != "rowwise":
        parser.error("--unfolded-peer applies to --recipe rowwise")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.grouped_linear needs a CUDA GPU")
    torch.autograd.set_multithreading_enabled(not args.single_thread_autograd)

    rows = []
    row_shapes = []
    if args.fine_grained:
        shapes = [(f"{name}: ", tuple(dims)) for name, *dims in FINE_GRAINED_SHAPES]
        routings = ALIGNED_ROUTINGS
    else:
        shapes = [("", tuple(shape)) for shape in ([args.shape] if args.shape else QUICK_SHAPES if args.quick else SHAPES)]
        routings = ROUTINGS
    for label, shape in shapes:
        for routing in routings:
            r = measure(
                shape, routing, ops.Fp8Recipe(name=args.recipe), args.cuda_graph, args.unfolded_peer,
                args.control_peer, args.micro_batches,
            )
            m, n, k, g = shape
            flops = 3 * 2 * m * n * k
            row_shapes.append({"M": m, "N": n, "K": k, "G": g})
            rows.append([
                f"{label}{m}x{n}x{k}, G={g}", routing, r["bf16"], r["torch fp8"], r["ours"],
                r["bf16"] / r["ours"], r["bf16"] / r["torch fp8"], flops / r["ours"] / 1e9,
                f"{r['ours sqnr']:.1f} / {r['torch fp8 sqnr']:.1f}",
            ])
            if args.unfolded_peer:
                rows[-1] += [r["ours unfolded"], r["bf16"] / r["ours unfolded"], f"{r['ours unfolded sqnr']:.1f}"]
            if args.control_peer:
                rows[-1].append(f"{r['ours again'] / r['ours']:.3f}")
            if args.micro_batches:
                rows[-1] += [r["ours reused"], r["bf16"] / r["ours reused"], f"{r['ours reused sqnr']:.1f}"]
            print(rows[-1], flush=True)
    headers = [
        "M x N x K, groups", "routing", "bf16 ms", "torch fp8 ms", "ours ms",
        "ours vs bf16", "torch fp8 vs bf16", "ours TFLOP/s", "min SQNR dB vs bf16 (ours / torch fp8)",
    ]
    if args.unfolded_peer:
        headers += ["ours unfolded ms", "unfolded vs bf16", "unfolded min SQNR dB"]
    if args.control_peer:
        headers.append("ours again / ours (same step)")
    if args.micro_batches:
        headers += ["ours reused ms per step", "reused vs bf16", "reused min SQNR dB"]
    command = " ".join(["python -m benchmarks.grouped_linear", *argv])
    report = (
        environment_header(f"Grouped linear, forward + backward: FP8 {args.recipe} vs bf16")
        + f"- command: `{command}`\n"
        + f"\nTime of out = x @ w[g]^T with dx and dw (3 GEMMs and all quantization), ours = the {args.recipe} "
        "recipe (`--recipe`), "
        "median of triton.testing.do_bench, peers timed in 4 rounds of rotating order (median per peer: "
        "the GPU's clock falls under sustained load, and a peer's place in a round moves its time). "
        "torch fp8 = PyTorch-op rowwise quantization "
        "(eager) + torch._scaled_grouped_mm. Skewed = Dirichlet(1) group sizes, multiples of 16. "
        + ("Sparse = Dirichlet(0.3) group sizes, multiples of 16: some experts get no tokens. " if "sparse" in routings else "")
        + f"Autograd backward on {'the calling thread' if args.single_thread_autograd else 'its device thread (default)'}."
        + (
            " Each peer's step is captured in a CUDA graph and replayed (`--cuda-graph`): GPU time, no host time."
            if args.cuda_graph
            else ""
        )
        + (
            " `ours unfolded` = the same recipe with `fold_dgrad_weight_scales=False` (`--unfolded-peer`):"
            " dgrad's weight quantized again along N instead of the forward scales folded into grad_out."
            if args.unfolded_peer
            else ""
        )
        + (
            " `ours again / ours`: the same step timed again as the last peer (`--control-peer`): the timing's spread."
            if args.control_peer
            else ""
        )
        + (
            f" `ours reused`: {args.micro_batches} steps in one `ops.reuse_quantized_weights()` block (gradient"
            " accumulation: only the first step quantizes the weight), time per step (`--micro-batches`)."
            if args.micro_batches
            else ""
        )
        + "\n\n"
        + markdown_table(headers, rows)
    )
    options = {
        "recipe": args.recipe,
        "cuda_graph": args.cuda_graph,
        "single_thread_autograd": args.single_thread_autograd,
        "micro_batches": args.micro_batches,
    }
    records = [{**shape, **dict(zip(headers, row))} for shape, row in zip(row_shapes, rows)]
    emit_report(report, args.out, {"command": command, "options": options, "headers": headers, "rows": records})


if __name__ == "__main__":
    main()
