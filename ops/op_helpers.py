"""What the ``fp8moe`` op modules (``ops.custom_ops*``) share: the FP8 dtype their schemas default to,
and the allocation and size arithmetic of their fake implementations.

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

DEFAULT_FLOAT8_DTYPE: torch.dtype = torch.float8_e4m3fn
"""The FP8 dtype an op quantizes to when the caller names none (``float8_dtype``'s default)."""


def empty_on(like: Tensor, shape: Sequence[IntLike], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous ``shape`` tensor of ``dtype`` on ``like``'s device (a fake op output)."""
    return torch.empty(shape, dtype=dtype, device=like.device)


def cdiv(a: IntLike, b: int) -> IntLike:
    """``ceil(a / b)`` for ``a >= 0`` and ``b > 0``."""
    return (a + b - 1) // b


def round_up(a: IntLike, multiple: int) -> IntLike:
    """The least multiple of ``multiple`` that is ``>= a``, for ``a >= 0`` and ``multiple > 0``."""
    return cdiv(a, multiple) * multiple
