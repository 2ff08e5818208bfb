"""Every kernel launcher as a PyTorch custom op in the ``fp8moe`` namespace.

Custom ops are opaque to ``torch.compile``: it calls them as they are (no graph
break) and uses the fake implementations registered here to know the shapes,
dtypes and strides of their outputs. FP8 outputs are returned as FP8 tensors.
Inputs are validated by the launchers (and, for users, by ``ops.functional``);
the fake implementations only describe outputs. Outputs are all fresh,
contiguous tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from ops.op_helpers import DEFAULT_FLOAT8_DTYPE, empty_on
from ops.op_registry import NAMESPACE, fp8moe_op  # noqa: F401  (NAMESPACE re-exported)


# --- quantization ------------------------------------------------------------


@fp8moe_op("quantize_rowwise_rows")
def quantize_rowwise_rows(
    x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(M, K)`` and scales ``(M,)``; see ``kernels_helion.quantize_rowwise``."""
    return kernels.quantize_rowwise_rows(x, float8_dtype, round_scales_to_power_of_2)


@quantize_rowwise_rows.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    m, k = x.shape
    return empty_on(x, (m, k), float8_dtype), empty_on(x, (m,), torch.float32)


@fp8moe_op("quantize_rowwise_expert_weights")
def quantize_rowwise_expert_weights(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(E, N, K)`` -> fp8 ``(E, N, K)`` and scales ``(E, N)`` (one per row, along ``K``)."""
    return kernels.quantize_rowwise_expert_weights(w, float8_dtype, round_scales_to_power_of_2)


@quantize_rowwise_expert_weights.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    e, n, k = w.shape
    return empty_on(w, (e, n, k), float8_dtype), empty_on(w, (e, n), torch.float32)


@fp8moe_op("quantize_rowwise_expert_weights_transposed")
def quantize_rowwise_expert_weights_transposed(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(E, N, K)`` -> fp8 ``(E, K, N)`` (``N`` contiguous) and scales ``(E, K)`` (along ``N``)."""
    return kernels.quantize_rowwise_expert_weights_transposed(w, float8_dtype, round_scales_to_power_of_2)


@quantize_rowwise_expert_weights_transposed.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    e, n, k = w.shape
    return empty_on(w, (e, k, n), float8_dtype), empty_on(w, (e, k), torch.float32)


@fp8moe_op("quantize_rowwise_expert_weights_both_layouts")
def quantize_rowwise_expert_weights_both_layouts(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both layouts of ``quantize_rowwise_expert_weights`` and ``..._transposed`` from one read of ``w``."""
    return kernels.quantize_rowwise_expert_weights_both_layouts(w, float8_dtype, round_scales_to_power_of_2)


@quantize_rowwise_expert_weights_both_layouts.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    e, n, k = w.shape
    return (
        empty_on(w, (e, n, k), float8_dtype),
        empty_on(w, (e, n), torch.float32),
        empty_on(w, (e, k, n), float8_dtype),
        empty_on(w, (e, k), torch.float32),
    )


@fp8moe_op("quantize_rowwise_expert_weights_and_transpose")
def quantize_rowwise_expert_weights_and_transpose(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """``quantize_rowwise_expert_weights`` and the same FP8 values stored ``(E, K, N)``."""
    return kernels.quantize_rowwise_expert_weights_and_transpose(w, float8_dtype, round_scales_to_power_of_2)


@quantize_rowwise_expert_weights_and_transpose.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    e, n, k = w.shape
    return (
        empty_on(w, (e, n, k), float8_dtype),
        empty_on(w, (e, n), torch.float32),
        empty_on(w, (e, k, n), float8_dtype),
    )


@fp8moe_op("quantize_rowwise_cols_grouped")
def quantize_rowwise_cols_grouped(
    x: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
    token_multipliers: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` (times ``token_multipliers[:, None]``, if given) -> fp8 ``(K, columns)`` (tokens contiguous,
    padded layout if ``group_alignment > 1``), scales ``(G, K)``."""
    return kernels.quantize_rowwise_cols_grouped(
        x, offs, float8_dtype, round_scales_to_power_of_2, group_alignment, token_multipliers
    )


@quantize_rowwise_cols_grouped.register_fake
def _(
    x, offs, float8_dtype=DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2=False, group_alignment=1,
    token_multipliers=None,
):
    m, k = x.shape
    columns = padded_token_count(m, offs.shape[0], group_alignment)
    return empty_on(x, (k, columns), float8_dtype), empty_on(x, (offs.shape[0], k), torch.float32)


@fp8moe_op("quantize_rowwise_rows_and_cols_grouped")
def quantize_rowwise_rows_and_cols_grouped(
    x: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
    row_multipliers: Tensor | None = None,
    token_multipliers: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize_rowwise_rows(x)`` (of ``x`` times its group's ``row_multipliers``, if given) and
    ``quantize_rowwise_cols_grouped(x, offs, ..., group_alignment, token_multipliers)`` in two reads of ``x``."""
    return kernels.quantize_rowwise_rows_and_cols_grouped(
        x, offs, float8_dtype, round_scales_to_power_of_2, group_alignment, row_multipliers, token_multipliers
    )


@quantize_rowwise_rows_and_cols_grouped.register_fake
def _(
    x, offs, float8_dtype=DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2=False, group_alignment=WGRAD_GROUP_ALIGNMENT,
    row_multipliers=None, token_multipliers=None,
):
    m, k = x.shape
    columns = padded_token_count(m, offs.shape[0], group_alignment)
    return (
        empty_on(x, (m, k), float8_dtype),
        empty_on(x, (m,), torch.float32),
        empty_on(x, (k, columns), float8_dtype),
        empty_on(x, (offs.shape[0], k), torch.float32),
    )


@fp8moe_op("quantize_rowwise_rows_and_transpose")
def quantize_rowwise_rows_and_transpose(
    x: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
) -> tuple[Tensor, Tensor, Tensor]:
    """``quantize_rowwise_rows(x)`` and the same FP8 values as columns of the padded token layout
    (``kernels_helion.transpose_to_token_groups``): fp8 ``(M, K)``, scales ``(M,)``, fp8 ``(K, columns)``."""
    return kernels.quantize_rowwise_rows_and_transpose(x, offs, float8_dtype, round_scales_to_power_of_2, group_alignment)


@quantize_rowwise_rows_and_transpose.register_fake
def _(
    x, offs, float8_dtype=DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2=False,
    group_alignment=WGRAD_GROUP_ALIGNMENT,
):
    m, k = x.shape
    columns = padded_token_count(m, offs.shape[0], group_alignment)
    return empty_on(x, (m, k), float8_dtype), empty_on(x, (m,), torch.float32), empty_on(x, (k, columns), float8_dtype)


@fp8moe_op("transpose_to_token_groups")
def transpose_to_token_groups(
    t: Tensor, offs: Tensor, group_alignment: int = WGRAD_GROUP_ALIGNMENT, rows: Tensor | None = None
) -> Tensor:
    """FP8 rows ``(M, K)`` (or ``t[rows]``) as the columns of the padded token layout ``(K, columns)``; see
    ``kernels_helion.transpose_to_token_groups``."""
    return kernels.transpose_to_token_groups(t, offs, group_alignment, rows)


@transpose_to_token_groups.register_fake
def _(t, offs, group_alignment=WGRAD_GROUP_ALIGNMENT, rows=None):
    m = t.shape[0] if rows is None else rows.shape[0]
    return empty_on(t, (t.shape[1], padded_token_count(m, offs.shape[0], group_alignment)), t.dtype)


@fp8moe_op("quantize_rowwise_cols_grouped_from_transposed")
def quantize_rowwise_cols_grouped_from_transposed(
    xt: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[Tensor, Tensor]:
    """``quantize_rowwise_cols_grouped`` of an already transposed ``xt (K, M)``: fp8 ``(K, columns)``, scales ``(G, K)``."""
    return kernels.quantize_rowwise_cols_grouped_from_transposed(xt, offs, float8_dtype, round_scales_to_power_of_2, group_alignment)


@quantize_rowwise_cols_grouped_from_transposed.register_fake
def _(xt, offs, float8_dtype=DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2=False, group_alignment=1):
    k, m = xt.shape
    columns = padded_token_count(m, offs.shape[0], group_alignment)
    return empty_on(xt, (k, columns), float8_dtype), empty_on(xt, (offs.shape[0], k), torch.float32)


@fp8moe_op("quantize_rowwise_wgrad_operands")
def quantize_rowwise_wgrad_operands(
    x: Tensor,
    grad_out: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize_rowwise_cols_grouped`` of ``x (M, K)`` and ``grad_out (M, N)`` in one launch."""
    return kernels.quantize_rowwise_wgrad_operands(
        x, grad_out, offs, float8_dtype, round_scales_to_power_of_2, group_alignment
    )


@quantize_rowwise_wgrad_operands.register_fake
def _(x, grad_out, offs, float8_dtype=DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2=False, group_alignment=1):
    m, k = x.shape
    n = grad_out.shape[1]
    g = offs.shape[0]
    columns = padded_token_count(m, g, group_alignment)
    return (
        empty_on(x, (k, columns), float8_dtype),
        empty_on(x, (g, k), torch.float32),
        empty_on(x, (n, columns), float8_dtype),
        empty_on(x, (g, n), torch.float32),
    )


# --- grouped GEMMs -----------------------------------------------------------


@fp8moe_op("grouped_mm_2d3d")
def grouped_mm_2d3d(
    a: Tensor,
    a_scales: Tensor,
    b: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``out[rows of g] = (a * a_scales) @ (b[g] * b_scales[g])^T``: ``(M, K) x (E, N, K) -> (M, N)``."""
    return kernels.grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype=out_dtype)


@grouped_mm_2d3d.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype=torch.bfloat16):
    return empty_on(a, (a.shape[0], b.shape[1]), out_dtype)


@fp8moe_op("grouped_mm_2d3d_split")
def grouped_mm_2d3d_split(
    a: Tensor,
    a_scales: Tensor,
    b_lo: Tensor,
    b_hi: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``a @ [b_lo | b_hi][g]^T`` per group, the weight split along the contraction: ``-> (M, N)``."""
    return kernels.grouped_mm_2d3d_split(a, a_scales, b_lo, b_hi, b_scales, offs, out_dtype=out_dtype)


@grouped_mm_2d3d_split.register_fake
def _(a, a_scales, b_lo, b_hi, b_scales, offs, out_dtype=torch.bfloat16):
    return empty_on(a, (a.shape[0], b_lo.shape[1]), out_dtype)


@fp8moe_op("grouped_mm_wgrad")
def grouped_mm_wgrad(
    a_t: Tensor,
    a_scales: Tensor,
    b_t: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    group_alignment: int = 1,
) -> Tensor:
    """``out[g] = a_t[:, tokens of g] @ b_t[:, tokens of g]^T`` with per-(group, row) scales: ``-> (G, N, K)``."""
    return kernels.grouped_mm_wgrad(
        a_t, a_scales, b_t, b_scales, offs, out_dtype=out_dtype, group_alignment=group_alignment
    )


@grouped_mm_wgrad.register_fake
def _(a_t, a_scales, b_t, b_scales, offs, out_dtype=torch.bfloat16, group_alignment=1):
    return empty_on(a_t, (offs.shape[0], a_t.shape[0], b_t.shape[0]), out_dtype)


@fp8moe_op("grouped_mm_wgrad_accumulate", mutates_args=("out",))
def grouped_mm_wgrad_accumulate(
    a_t: Tensor, a_scales: Tensor, b_t: Tensor, b_scales: Tensor, offs: Tensor, out: Tensor, group_alignment: int = 1
) -> None:
    """``grouped_mm_wgrad`` added into ``out (G, N, K)`` (fp32/bf16/fp16; gradient accumulation)."""
    kernels.grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, out=out, group_alignment=group_alignment)


@grouped_mm_wgrad_accumulate.register_fake
def _(a_t, a_scales, b_t, b_scales, offs, out, group_alignment=1):
    return None


@fp8moe_op("transpose_fp8")
def transpose_fp8(t: Tensor) -> Tensor:
    """FP8 ``(E, R, C)`` -> the same values stored ``(E, C, R)``; see ``kernels_helion.transpose_fp8``."""
    return kernels.transpose_fp8(t)


@transpose_fp8.register_fake
def _(t: Tensor):
    e, r, c = t.shape
    return empty_on(t, (e, c, r), t.dtype)
