"""What the ``fp8moe`` op modules (``ops.custom_ops*``) share: the allocation and size arithmetic of
their fake implementations.

The size helpers take plain ints and ``torch.SymInt`` alike: under dynamic
shapes a fake implementation sees symbolic sizes, so they use only ``+`` and
``//`` (no ``math`` functions, no ``int()``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import SymInt, Tensor

IntLike = int | SymInt
"""A size: an ``int``, or a ``torch.SymInt`` inside a fake implementation under dynamic shapes."""

F32: torch.dtype = torch.float32
"""The dtype of rowwise and blockwise scales."""


def empty_on(like: Tensor, shape: Sequence[IntLike], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous ``shape`` tensor of ``dtype`` on ``like``'s device (a fake op output)."""
    return torch.empty(shape, dtype=dtype, device=like.device)


def cdiv(a: IntLike, b: int) -> IntLike:
    """``ceil(a / b)`` for ``a >= 0`` and ``b > 0``."""
    return (a + b - 1) // b


def round_up(a: IntLike, multiple: int) -> IntLike:
    """The least multiple of ``multiple`` that is ``>= a``, for ``a >= 0`` and ``multiple > 0``."""
    return cdiv(a, multiple) * multiple


def grouped_mm_outputs(a: Tensor, b: Tensor, out_dtype: torch.dtype, **_: object) -> Tensor:
    """Fake of a grouped GEMM ``(M, K) x (E, N, K) -> (M, N)``."""
    return empty_on(a, (a.shape[0], b.shape[1]), out_dtype)


def wgrad_outputs(a_t: Tensor, b_t: Tensor, offs: Tensor, out_dtype: torch.dtype, **_: object) -> Tensor:
    """Fake of a grouped wgrad GEMM: ``(G, N, K)`` from ``a_t (N, ...)`` and ``b_t (K, ...)``."""
    return empty_on(a_t, (offs.shape[0], a_t.shape[0], b_t.shape[0]), out_dtype)
