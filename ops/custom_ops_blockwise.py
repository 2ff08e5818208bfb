"""The blockwise recipe's kernel launchers (DeepSeek-V3: 1x128 / 128x1 / 128x128 scales) as ``fp8moe`` custom ops.

As ``ops.custom_ops``: one ``kernel_op`` declaration per launcher, opaque to
``torch.compile``, called without the dispatcher in eager mode
(``ops.op_registry.kernel_ops``); the launchers validate inputs. Each op takes
the launcher's ``block`` (128 by default, what the blockwise GEMMs take). Two
layouts are not plain contiguous tensors, and the fakes describe them exactly:

- 1x128 scales ``(M, ceil(K/128))`` are K-block-major, a transposed view of a
  contiguous ``(ceil(K/128), round_up(M, 4))`` buffer (``quantize_blockwise_rows``);
- per-group 128x1 scales have ``R = ceil(M/128) + G`` rows, an upper bound on the
  number of token blocks known from the shapes alone (no sync), and the
  transposed fp8 tensor they scale is ``(K, R * 128)`` in block space (block
  ``r`` owns columns ``[128 r, 128 r + 128)``, zero-padded).
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.quantize_blockwise import SCALE_ROW_ALIGN
from ops.op_helpers import F32, cdiv, empty_on, grouped_mm_outputs, round_up, wgrad_outputs
from ops.op_registry import kernel_op


def fake_act_block_scales(x: Tensor, block: int) -> Tensor:
    """Fake 1x128 scales of ``x (M, K)``: ``(M, ceil(K/128))`` fp32, K-block-major as ``quantize_blockwise_rows``
    lays them out (a transposed view of a ``(ceil(K/128), round_up(M, SCALE_ROW_ALIGN))`` buffer)."""
    m, k = x.shape
    return empty_on(x, (cdiv(k, block), round_up(m, SCALE_ROW_ALIGN)), F32)[:, :m].t()


def fake_rows(x: Tensor, float8_dtype: torch.dtype, block: int, **_: object) -> tuple[Tensor, Tensor]:
    """Fake ``quantize_blockwise_rows``: fp8 ``(M, K)`` and 1x128 scales ``(M, ceil(K/128))`` (K-block-major)."""
    return empty_on(x, x.shape, float8_dtype), fake_act_block_scales(x, block)


def _fake_cols_grouped(
    x: Tensor, offs: Tensor, float8_dtype: torch.dtype, block: int, **_: object
) -> tuple[Tensor, Tensor, Tensor]:
    """fp8 ``(K, R * 128)`` (block space), per-group 128x1 scales ``(R, K)``, block map ``(G,)``."""
    m, k = x.shape
    block_rows = cdiv(m, block) + offs.shape[0]
    return (
        empty_on(x, (k, block_rows * block), float8_dtype),
        empty_on(x, (block_rows, k), F32),
        empty_on(x, (offs.shape[0],), torch.int32),
    )


def _fake_weights(w: Tensor, float8_dtype: torch.dtype, block: int, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """``([E,] rows, cols)`` fp8 and 128x128 scales, for ``(N, K)`` or ``(E, N, K)`` weights."""
    *experts, n, k = w.shape
    rows, cols = (k, n) if transposed else (n, k)
    return (
        empty_on(w, (*experts, rows, cols), float8_dtype),
        empty_on(w, (*experts, cdiv(rows, block), cdiv(cols, block)), F32),
    )


def _grouped_mm_wgrad_blockwise(
    a_t: Tensor,
    a_scales: Tensor,
    b_t: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    group_block_starts: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``out[g] = a_t[:, blocks of g] @ b_t[:, blocks of g]^T`` with per-group 128x1 scales: ``-> (G, N, K)``.

    ``a_t (N, R * 128)`` and ``b_t (K, R * 128)`` are in block space (``quantize_blockwise_cols_grouped``).
    """
    return kernels.grouped_mm_wgrad_blockwise(
        a_t, a_scales, b_t, b_scales, offs, group_block_starts, out_dtype=out_dtype
    )


# --- activations and gradients -------------------------------------------------------

quantize_blockwise_rows = kernel_op(kernels.quantize_blockwise_rows, fake_rows)
quantize_blockwise_cols_grouped = kernel_op(kernels.quantize_blockwise_cols_grouped, _fake_cols_grouped)
quantize_blockwise_rows_and_cols_grouped = kernel_op(
    kernels.quantize_blockwise_rows_and_cols_grouped, lambda **a: (*fake_rows(**a), *_fake_cols_grouped(**a))
)

# --- expert weights --------------------------------------------------------------------

quantize_blockwise_weights = kernel_op(
    kernels.quantize_blockwise_weights, lambda w, float8_dtype, block, **_: _fake_weights(w, float8_dtype, block)
)
quantize_blockwise_weights_transposed = kernel_op(
    kernels.quantize_blockwise_weights_transposed,
    lambda w, float8_dtype, block, **_: _fake_weights(w, float8_dtype, block, transposed=True),
)
quantize_blockwise_weights_both_layouts = kernel_op(
    kernels.quantize_blockwise_weights_both_layouts,
    lambda w, float8_dtype, block, **_: (
        *_fake_weights(w, float8_dtype, block), *_fake_weights(w, float8_dtype, block, transposed=True)
    ),
)

# --- grouped GEMMs ---------------------------------------------------------------------

grouped_mm_2d3d_blockwise = kernel_op(kernels.grouped_mm_2d3d_blockwise, grouped_mm_outputs)
grouped_mm_wgrad_blockwise = kernel_op(_grouped_mm_wgrad_blockwise, wgrad_outputs, name="grouped_mm_wgrad_blockwise")
