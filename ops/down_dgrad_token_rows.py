"""Which form the down-projection's (``w2``'s) dgrad takes: ``RowwiseOptions.down_dgrad_token_rows``.

Where the fused experts take the combine, ``dH = dY_pairs @ w2`` can read its rows two ways:

- folded (``False``): the ``T * k`` pair rows ``grad[token] * prob`` quantized rowwise with
  ``w2``'s forward scales multiplied in, against ``w2``'s forward FP8 bytes copied transposed;
- token rows (``True``): the output gradient's ``T`` token rows, each quantized rowwise once (a
  rowwise scale belongs to its token), read by index inside the GEMM, against ``w2`` quantized
  along ``N``. The FP8 wgrad then reads the token rows too (``RowwiseOptions.down_wgrad_token_rows``)
  or takes the pair rows' per-group column form alone, but ``w2`` is read for a second layout.

The first saves passes over the pair rows, the second costs a pass over ``w2``: token rows pay
where the pair rows outweigh the weight, that is with many rows per expert and the FP8 wgrad (whose
two passes over the pair rows shrink). Measured on the MoE layer on an H100, two runs
(``benchmarks/results/token_rows/``, ``docs/performance.md``): against the folded form, 1.01x the
speed at 2048 rows per expert and 1.00-1.03x at 8192 (FP8 wgrad; 0.1 and 0.8-1.3 ms less kernel time
a step), 0.98x at 512 (bf16 wgrad).

``"auto"`` (default) takes token rows on Hopper when the wgrad is FP8 and the groups average at
least ``TOKEN_ROWS_MIN_ROWS_PER_GROUP`` rows, else the folded form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ops import wgrad_precision

if TYPE_CHECKING:
    from ops.recipes import Fp8Recipe

# "auto" takes token rows on Hopper from this many rows (routed pairs) per expert on average: the
# smallest measured win (Qwen3-30B-like, 32768 tokens); 512 rows per expert measured a loss.
TOKEN_ROWS_MIN_ROWS_PER_GROUP = 2048


def check_down_dgrad_token_rows(value: object) -> bool | str:
    """``value`` if it is ``True``, ``False`` or ``"auto"``, else a TypeError naming them."""
    if not (isinstance(value, bool) or value == "auto"):
        raise TypeError(f"down_dgrad_token_rows must be True, False or 'auto', got {value!r}")
    return value


def auto_takes_token_rows(on_hopper: bool, fp8_wgrad: bool, num_rows: int, num_groups: int) -> bool:
    """``"auto"``'s rule (see ``resolve_down_dgrad_token_rows``), from what it reads of the call."""
    return on_hopper and fp8_wgrad and num_rows >= TOKEN_ROWS_MIN_ROWS_PER_GROUP * max(num_groups, 1)


def resolve_down_dgrad_token_rows(
    recipe: Fp8Recipe, x: Tensor, num_rows: int, num_groups: int, fp8_wgrad: bool
) -> bool:
    """Whether a grouped linear's dgrad reads token rows: ``recipe.down_dgrad_token_rows`` resolved for one call.

    ``x``: the input (its device); ``num_rows``: the GEMM's rows (the routed pairs);
    ``num_groups``: the experts; ``fp8_wgrad``: the call computes an FP8 weight gradient.
    Shapes only: no device sync. The grouped linear applies it only where it can (the
    fused experts' down-projection with the combine; see ``RowwiseOptions``).
    """
    choice = recipe.down_dgrad_token_rows
    if choice != "auto":
        return choice
    return auto_takes_token_rows(wgrad_precision.on_hopper(x), fp8_wgrad, num_rows, num_groups)
