"""Which precision an expert weight's gradient (wgrad) is computed in: FP8 or bf16 (``Fp8Recipe.wgrad_precision``).

``dW[g] = grad_out[g]^T @ x[g]`` contracts over each group's tokens. With many
small groups (fine-grained MoEs: a few hundred tokens per expert) the FP8 wgrad
pays for operand quantizations and transposed copies that a short contraction
cannot win back, and a bf16 grouped GEMM (``torch._grouped_mm``, CUTLASS on
Hopper) on the activations' own values is faster and exact to bf16. With large
groups the FP8 wgrad is faster. The choices:

- ``"fp8"``: the recipe's FP8 wgrad (its operands quantized per group along the tokens).
- ``"bf16"``: a bf16 grouped GEMM on ``grad_out`` and ``x`` (other dtypes are cast), the
  result in the weight's dtype: ``torch._grouped_mm`` (CUTLASS) for a new gradient, our
  ``grouped_mm_wgrad_bf16`` kernel when it adds into one (``wgrad_accumulation``: its
  epilogue adds, 1.05-1.45x CUTLASS plus the add pass on the H200; a new gradient it
  writes at 0.75-1.04x CUTLASS's speed, so CUTLASS keeps that). ``x`` is then saved for
  backward in its own dtype instead of its FP8 wgrad form. It needs ``x``'s values (not
  FP8 rows made elsewhere: expert parallelism's FP8 dispatch) and both GEMM dimensions a
  multiple of 8 (``torch._grouped_mm``'s 16-byte strides).
- ``"auto"`` (default): ``"bf16"`` where it measured faster (the rowwise recipe on Hopper
  at a few hundred rows per expert, unless it adds into a ``.grad`` much larger than those
  rows), else ``"fp8"`` (``resolve_wgrad_precision``).

``rows`` (the fused up-projection): ``x`` holds each token once and group row ``i``
is ``x[rows[i]]``; it is gathered in bf16 for ``torch._grouped_mm``, read by index by
the accumulating kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

import ops.custom_ops  # noqa: F401  (defines the fp8moe ops used below)
from ops.op_registry import kernel_ops

if TYPE_CHECKING:
    from ops.recipes import Fp8Recipe

WGRAD_PRECISIONS = ("auto", "fp8", "bf16")

# "auto" takes the bf16 wgrad on Hopper when the groups average fewer rows than this.
# Measured on the MoE layer (benchmarks/results/wgrad_precision/, docs/performance.md): at
# 256 and 512 rows per expert the bf16 wgrad is the faster, at 2048 and 8192 the FP8 one.
BF16_WGRAD_MAX_ROWS_PER_GROUP = 1024

# Adding into a 16-bit .grad (wgrad_accumulation="grad"), the FP8 wgrad prefetches the gradient's
# tiles into L2 and runs 1.12-1.13x faster than without at DeepSeek-V3-like 256 experts
# (kernels_helion.l2_prefetch). There each group's dW has many elements per element of the rows it
# contracts, N * K / (rows * (N + K)) = 6.2, the add into the gradient dominates, and the layer
# ran 1.23x our bf16 layer with the FP8 wgrad against 1.15x with the bf16 one; at Qwen3-30B-like
# 8192 tokens (1.09) the bf16 wgrad stayed ahead, 1.10x against 0.99x
# (benchmarks/results/wgrad_prefetch/, H200). "auto" takes FP8 there from this ratio up.
ACCUMULATING_FP8_WGRAD_MIN_RATIO = 3.0

# torch._grouped_mm needs 16-byte strides: 8 bf16 elements.
_GROUPED_MM_DIM_MULTIPLE = 8


def check_wgrad_precision(value: object) -> str:
    """``value`` if it is one of ``WGRAD_PRECISIONS``, else a ValueError naming them."""
    if not isinstance(value, str) or value not in WGRAD_PRECISIONS:
        raise ValueError(f"wgrad_precision must be one of {list(WGRAD_PRECISIONS)}, got {value!r}")
    return value


@torch.compiler.assume_constant_result
def _is_hopper(device_index: int | None) -> bool:
    """Whether CUDA device ``device_index`` (``None``: the current one) is sm90 (a constant under torch.compile)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _bf16_fits(n: int, k: int) -> bool:
    return n % _GROUPED_MM_DIM_MULTIPLE == 0 and k % _GROUPED_MM_DIM_MULTIPLE == 0


def resolve_wgrad_precision(
    recipe: Fp8Recipe, x: Tensor, num_rows: int, num_groups: int, out_features: int, has_values: bool
) -> bool:
    """Whether the wgrad of a grouped linear runs in bf16: ``recipe.wgrad_precision`` resolved for one call, on the host.

    ``x``: the input (its device, dtype and columns ``K``); ``num_rows``: the GEMM's rows
    (the routed pairs); ``out_features``: ``N``; ``has_values``: ``x`` holds its values
    (``False`` for FP8 rows made elsewhere). ``"auto"`` takes bf16 for the rowwise recipe
    (where it was measured; the others keep FP8) on a Hopper GPU, for a bf16 ``x`` of
    aligned dimensions whose groups average fewer than ``BF16_WGRAD_MAX_ROWS_PER_GROUP``
    rows (with ``wgrad_accumulation`` too: both wgrads add into the gradient in their
    epilogues), except that adding into ``.grad`` it keeps FP8 where each group's ``dW``
    is large against its rows (``ACCUMULATING_FP8_WGRAD_MIN_RATIO``). ``"bf16"`` where it
    cannot run raises a ValueError naming the rule, before any kernel runs. Shapes only: no device sync.
    """
    k = x.shape[-1]
    precision = recipe.wgrad_precision
    if precision == "fp8":
        return False
    if precision == "bf16":
        if not has_values:
            raise ValueError(
                "wgrad_precision='bf16' needs x's values, but x arrives as FP8 rows (expert parallelism's FP8 "
                "dispatch); use 'fp8' or 'auto'"
            )
        if not _bf16_fits(out_features, k):
            raise ValueError(
                f"wgrad_precision='bf16' needs both GEMM dimensions a multiple of {_GROUPED_MM_DIM_MULTIPLE} "
                f"(torch._grouped_mm), got N={out_features}, K={k}; use 'fp8' or 'auto'"
            )
        return True
    return recipe.auto_wgrad_may_take_bf16 and auto_takes_bf16(
        on_hopper(x), x.dtype, num_rows, num_groups, out_features, k, has_values, recipe.wgrad_accumulation
    )


def on_hopper(x: Tensor) -> bool:
    """Whether ``x`` lives on a Hopper GPU."""
    return x.device.type == "cuda" and _is_hopper(x.device.index)


def auto_takes_bf16(
    on_hopper: bool,
    dtype: torch.dtype,
    num_rows: int,
    num_groups: int,
    out_features: int,
    in_features: int,
    has_values: bool,
    accumulation: str = "off",
) -> bool:
    """``"auto"``'s rule (see ``resolve_wgrad_precision``), from what it reads of the call.

    ``accumulation``: the recipe's ``wgrad_accumulation``.
    """
    groups = max(num_groups, 1)
    if accumulation == "grad" and out_features * in_features * groups >= (
        ACCUMULATING_FP8_WGRAD_MIN_RATIO * num_rows * (out_features + in_features)
    ):
        return False
    return (
        on_hopper
        and has_values
        and dtype == torch.bfloat16
        and _bf16_fits(out_features, in_features)
        and num_rows < BF16_WGRAD_MAX_ROWS_PER_GROUP * groups
    )


def grouped_mm_wgrad_bf16(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype,
    rows: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``dW[g] = grad_out[g]^T @ x[g]`` per group of ``offs`` in bf16 -> ``(G, N, K)`` in ``out_dtype``.

    ``grad_out``: ``(P, N)`` (a column slice of a wider tensor will do); ``x``: ``(P, K)``,
    or ``(T, K)`` tokens with ``rows`` ``(P,)`` naming each group row's token. Rows past
    ``offs[-1]`` are not read; an empty group's ``dW`` is 0.

    A new gradient comes from ``torch._grouped_mm`` (CUTLASS; ``x`` gathered to the rows
    first). With ``out`` (a gradient to add into, fp32 or of the weight's dtype)
    ``kernels_helion.grouped_mm_wgrad_bf16`` adds ``dW`` in its epilogue and reads the
    tokens by index: no gathered copy of ``x`` and no separate add pass
    (``benchmarks/results/wgrad_precision/wgrad_bf16_h200.md``); ``out`` is returned.
    """
    a = grad_out if grad_out.dtype == torch.bfloat16 else grad_out.to(torch.bfloat16)
    b = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if out is not None:
        kernel_ops.grouped_mm_wgrad_bf16_accumulate(a, b, offs, rows, out)
        return out
    if rows is not None:
        b = b.index_select(0, rows)
    # CUTLASS trusts the group ends: bounded and made non-decreasing here (no change to valid ones), so
    # that bad offsets give wrong groups, as in our kernels, never a read past the rows.
    offs = offs.clamp(0, a.shape[0]).cummax(0).values
    dw = torch._grouped_mm(a.t(), b, offs=offs)
    return dw if dw.dtype == out_dtype else dw.to(out_dtype)
