"""Row gathers of the MoE layer (token permutations, expert-parallel reordering), moved as wide words,
and the sum of each token's pair rows that is the gradient of gathering them.

PyTorch's CUDA ``index_select`` copies one element per thread and computes each
element's source and destination offsets with integer divisions. For rows of 1-,
2- or 4-byte elements that arithmetic, not memory, sets the pace: a bf16 row of
2048 values is 2048 such copies, the same row seen as int64 words 512. The bytes
moved are the same and the result is bitwise the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import ops.custom_ops_moe  # noqa: F401  (defines the fp8moe combine op used below)
from ops.op_registry import kernel_ops

# Widest first: a row is moved as the widest of these words that divides its bytes and its start.
_WORDS = (torch.int64, torch.int32, torch.int16)


def row_word(t: Tensor) -> torch.dtype | None:
    """The widest integer word wider than ``t``'s elements that divides each row's bytes and start, else ``None``.

    ``None`` also for tensors that are not contiguous or have fewer than two dimensions.
    """
    if t.dim() < 2 or not t.is_contiguous():
        return None
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    start = t.storage_offset() * t.element_size()
    for word in _WORDS:
        size = word.itemsize
        if size > t.element_size() and row_bytes % size == 0 and start % size == 0:
            return word
    return None


def gather_rows(t: Tensor, index: Tensor) -> Tensor:
    """``t.index_select(0, index)``, each row moved as ``row_word(t)`` words where there is one.

    Under ``torch.compile`` a plain ``index_select``: Inductor writes its own gather kernel.
    """
    word = None if torch.compiler.is_compiling() else row_word(t)
    if word is None:
        return t.index_select(0, index)
    rows = t.view(t.shape[0], math.prod(t.shape[1:])).view(word)
    return rows.index_select(0, index).view(t.dtype).view(index.shape[0], *t.shape[1:])


def sum_pair_rows(rows: Tensor, inverse: Tensor) -> Tensor:
    """``out[t] = sum_j rows[inverse[t, j]]``: each token's pair rows summed in float32 in the order
    ``j = 0 .. k-1`` (``moe_combine`` with unit weights), read once; ``(T, dim)`` in ``rows``' dtype.

    The gradient of a gather of token rows: ``ops.moe``'s token gather and ``ops.moe_fused`` both sum
    with it, so the two paths give bitwise the same ``dx`` for the same pair gradients.
    """
    ones = torch.ones(inverse.shape, dtype=torch.float32, device=rows.device)
    return kernel_ops.moe_combine(rows, inverse, ones)
