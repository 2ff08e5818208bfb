"""The rowwise recipe's kernel launchers as ``fp8moe`` custom ops, one ``kernel_op`` declaration each.

Custom ops are opaque to ``torch.compile``: it calls them as they are (no graph
break) and uses each declaration's fake (its second argument) to know the
shapes, dtypes and strides of the outputs. FP8 outputs are returned as FP8
tensors. Inputs are validated by the launchers (and, for users, by
``ops.functional``); the fakes only describe outputs. Outputs are all fresh,
contiguous tensors. A launcher whose signature is not the op's (an ``out``
argument) runs through a small adapter written here.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.token_groups import padded_token_count
from ops.op_helpers import F32, empty_on, grouped_mm_outputs, wgrad_outputs
from ops.op_registry import NAMESPACE, kernel_op  # noqa: F401  (NAMESPACE re-exported)


def _rows(x: Tensor, float8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Fake rowwise forms of ``x (M, K)``: fp8 ``(M, K)`` and scales ``(M,)``."""
    return empty_on(x, x.shape, float8_dtype), empty_on(x, x.shape[:1], F32)


def _cols_grouped(x: Tensor, offs: Tensor, float8_dtype: torch.dtype, group_alignment: int) -> tuple[Tensor, Tensor]:
    """Fake per-group column forms of ``x (M, K)``: fp8 ``(K, columns)`` (padded token layout), scales ``(G, K)``."""
    m, k = x.shape
    columns = padded_token_count(m, offs.shape[0], group_alignment)
    return empty_on(x, (k, columns), float8_dtype), empty_on(x, (offs.shape[0], k), F32)


def _pair_rows(x: Tensor, pair_tokens: Tensor | None) -> Tensor:
    """Fake rows a quantizer or GEMM reads: ``x``'s, or, gathered, one row of ``x``'s width per entry of ``pair_tokens``."""
    return x if pair_tokens is None else empty_on(x, (pair_tokens.shape[0], x.shape[1]), x.dtype)


def _weights(w: Tensor, float8_dtype: torch.dtype, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """Fake rowwise forms of expert weights ``(E, N, K)``: fp8 ``(E, N, K)``, scales ``(E, N)``; transposed
    ``(E, K, N)`` and ``(E, K)``."""
    e, n, k = w.shape
    rows, cols = (k, n) if transposed else (n, k)
    return empty_on(w, (e, rows, cols), float8_dtype), empty_on(w, (e, rows), F32)


# --- quantization ------------------------------------------------------------

quantize_rowwise_rows = kernel_op(
    kernels.quantize_rowwise_rows, lambda x, float8_dtype, rows=None, **_: _rows(_pair_rows(x, rows), float8_dtype)
)
quantize_rowwise_expert_weights = kernel_op(
    kernels.quantize_rowwise_expert_weights, lambda w, float8_dtype, **_: _weights(w, float8_dtype)
)
quantize_rowwise_expert_weights_transposed = kernel_op(
    kernels.quantize_rowwise_expert_weights_transposed, lambda w, float8_dtype, **_: _weights(w, float8_dtype, True)
)
quantize_rowwise_expert_weights_both_layouts = kernel_op(
    kernels.quantize_rowwise_expert_weights_both_layouts,
    lambda w, float8_dtype, **_: (*_weights(w, float8_dtype), *_weights(w, float8_dtype, True)),
)
quantize_rowwise_expert_weights_and_transpose = kernel_op(
    kernels.quantize_rowwise_expert_weights_and_transpose,
    lambda w, float8_dtype, **_: (*_weights(w, float8_dtype), _weights(w, float8_dtype, True)[0]),
)
quantize_rowwise_cols_grouped = kernel_op(
    kernels.quantize_rowwise_cols_grouped,
    lambda x, offs, float8_dtype, group_alignment, pair_tokens=None, **_: _cols_grouped(
        _pair_rows(x, pair_tokens), offs, float8_dtype, group_alignment
    ),
)
quantize_rowwise_rows_and_cols_grouped = kernel_op(
    kernels.quantize_rowwise_rows_and_cols_grouped,
    lambda x, offs, float8_dtype, group_alignment, pair_tokens=None, **_: (
        *_rows(_pair_rows(x, pair_tokens), float8_dtype),
        *_cols_grouped(_pair_rows(x, pair_tokens), offs, float8_dtype, group_alignment),
    ),
)
quantize_rowwise_rows_and_transpose = kernel_op(
    kernels.quantize_rowwise_rows_and_transpose,
    lambda x, offs, float8_dtype, group_alignment, **_: (
        *_rows(x, float8_dtype), _cols_grouped(x, offs, float8_dtype, group_alignment)[0]
    ),
)
transpose_to_token_groups = kernel_op(
    kernels.transpose_to_token_groups,
    lambda t, offs, group_alignment, rows: empty_on(
        t, (t.shape[1], padded_token_count(t.shape[0] if rows is None else rows.shape[0], offs.shape[0], group_alignment)),
        t.dtype,
    ),
)

# --- grouped GEMMs -----------------------------------------------------------

grouped_mm_2d3d = kernel_op(
    kernels.grouped_mm_2d3d,
    lambda a, b, out_dtype, rows=None, **_: grouped_mm_outputs(_pair_rows(a, rows), b, out_dtype),
)
grouped_mm_2d3d_split = kernel_op(
    kernels.grouped_mm_2d3d_split, lambda a, b_lo, out_dtype, **_: empty_on(a, (a.shape[0], b_lo.shape[1]), out_dtype)
)


def _grouped_mm_wgrad(
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


def _grouped_mm_wgrad_accumulate(
    a_t: Tensor, a_scales: Tensor, b_t: Tensor, b_scales: Tensor, offs: Tensor, out: Tensor, group_alignment: int = 1
) -> None:
    """``grouped_mm_wgrad`` added into ``out (G, N, K)`` (fp32/bf16/fp16; gradient accumulation)."""
    kernels.grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, out=out, group_alignment=group_alignment)


grouped_mm_wgrad = kernel_op(_grouped_mm_wgrad, wgrad_outputs, name="grouped_mm_wgrad")
grouped_mm_wgrad_accumulate = kernel_op(
    _grouped_mm_wgrad_accumulate, lambda **_: None, name="grouped_mm_wgrad_accumulate", mutates_args=("out",)
)


def _grouped_mm_wgrad_bf16_accumulate(a: Tensor, b: Tensor, offs: Tensor, index: Tensor | None, out: Tensor) -> None:
    """``out[g] += a[rows of g]^T @ b[rows of g]`` (``b[index[p]]`` with ``index``) in 16 bits, fp32 sum in the epilogue."""
    kernels.grouped_mm_wgrad_bf16(a, b, offs, index=index, out=out)


grouped_mm_wgrad_bf16_accumulate = kernel_op(
    _grouped_mm_wgrad_bf16_accumulate, lambda **_: None, name="grouped_mm_wgrad_bf16_accumulate", mutates_args=("out",)
)
transpose_fp8 = kernel_op(
    kernels.transpose_fp8, lambda t: empty_on(t, (t.shape[0], t.shape[2], t.shape[1]), t.dtype)
)
