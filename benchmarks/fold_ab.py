"""The rowwise recipe with and without one of its folds of scales into ``grad_out``: a fair A/B.

    python -m benchmarks.fold_ab --fold {dgrad,wgrad} [--out FILE]

``--fold dgrad``: ``RowwiseOptions.fold_dgrad_weight_scales`` on and off; ``--fold wgrad``:
``RowwiseOptions.fold_wgrad_input_scales`` on and off (the other fold keeps its default).
``benchmarks.grouped_linear --unfolded-peer`` times the dgrad pair among four peers, where
the position of a peer in the rounds moves its time by a few percent, more than
the two differ. Here each layer's forward + backward is captured in a CUDA graph
(GPU time only) and only the two are timed, in both orders
(``benchmarks.common.bench_peers_us``, 6 rounds each, which alternate), so the ratio in each order
shows how far position alone moves it.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

import ops
from benchmarks.common import bench_peers_us, emit_report, environment_header, markdown_table, offsets, routed_group_sizes
from benchmarks.grouped_linear import ROUTINGS, SHAPES, captured


# The recipe field each ``--fold`` switches.
FOLDS = {"dgrad": "fold_dgrad_weight_scales", "wgrad": "fold_wgrad_input_scales"}
_DESCRIPTIONS = {"dgrad": "dgrad weight scales", "wgrad": "wgrad input (row) scales"}


def measure(shape: tuple[int, int, int, int], routing: str, fold: str) -> tuple[dict[str, float], dict[str, float]]:
    """Times (us) of the folded and unfolded recipe's graph replays, timed in both orders."""
    m, n, k, g = shape
    offs = offsets(routed_group_sizes(m, g, routing))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device="cuda") * k**-0.5).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step(recipe: ops.Fp8Recipe) -> None:
        x.grad = w.grad = None
        ops.fp8_grouped_linear(x, w, offs, recipe).backward(grad_out)

    folded = captured(functools.partial(step, ops.Fp8Recipe(options=ops.RowwiseOptions(**{FOLDS[fold]: True}))))
    unfolded = captured(functools.partial(step, ops.Fp8Recipe(options=ops.RowwiseOptions(**{FOLDS[fold]: False}))))
    first = bench_peers_us({"folded": folded, "unfolded": unfolded}, rounds=6)
    second = bench_peers_us({"unfolded": unfolded, "folded": folded}, rounds=6)
    return first, second


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fold", choices=sorted(FOLDS), required=True, help="which fold to switch")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fold_ab needs a CUDA GPU")
    rows = []
    for shape in SHAPES:
        for routing in ROUTINGS:
            first, second = measure(shape, routing, args.fold)
            m, n, k, g = shape
            rows.append([
                f"{m}x{n}x{k}, G={g}", routing, first["folded"] / 1e3, first["unfolded"] / 1e3,
                f'{first["folded"] / first["unfolded"]:.3f}', second["folded"] / 1e3, second["unfolded"] / 1e3,
                f'{second["folded"] / second["unfolded"]:.3f}',
            ])
            print(rows[-1], flush=True)
    headers = [
        "M x N x K, groups", "routing", "folded ms (folded first)", "unfolded ms", "folded / unfolded",
        "folded ms (unfolded first)", "unfolded ms", "folded / unfolded",
    ]
    report = (
        environment_header(
            f"Rowwise recipe: {_DESCRIPTIONS[args.fold]} folded into grad_out or not (fwd + bwd, CUDA graphs)"
        )
        + f"\nCommand: `python -m benchmarks.fold_ab --fold {args.fold}`. Recipe `{FOLDS[args.fold]}` True against"
        " False, the other fold at its default. Ratios below 1: the folded recipe (the default) is faster.\n\n"
        + markdown_table(headers, rows)
    )
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
