"""The MoE layer's combine kernels (``kernels_helion.moe_combine``) as ``fp8moe`` custom ops, with their fakes.

``ops.moe.combine_pairs`` supplies the autograd formula around them.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from ops.op_helpers import empty_on
from ops.op_registry import fp8moe_op


@fp8moe_op("moe_combine")
def moe_combine(y: Tensor, inverse: Tensor, probs: Tensor) -> Tensor:
    """``sum_j probs[t, j] * y[inverse[t, j]]`` in float32: ``(T, D)`` of ``y``'s dtype; see ``kernels_helion.moe_combine``."""
    return kernels.moe_combine(y, inverse, probs)


@moe_combine.register_fake
def _(y, inverse, probs):
    return empty_on(y, (probs.shape[0], y.shape[1]), y.dtype)


@fp8moe_op("moe_combine_grad_rows")
def moe_combine_grad_rows(grad: Tensor, order: Tensor, probs: Tensor, y: Tensor) -> Tensor:
    """``moe_combine``'s gradient for ``y``: ``(T * k, D)``; see ``kernels_helion.moe_combine_grad_rows``."""
    return kernels.moe_combine_grad_rows(grad, order, probs, y)


@moe_combine_grad_rows.register_fake
def _(grad, order, probs, y):
    return empty_on(y, y.shape, y.dtype)


@fp8moe_op("moe_combine_grad_probs")
def moe_combine_grad_probs(grad: Tensor, y: Tensor, inverse: Tensor) -> Tensor:
    """``moe_combine``'s gradient for ``probs``: ``(T, k)`` float32; see ``kernels_helion.moe_combine_grad_probs``."""
    return kernels.moe_combine_grad_probs(grad, y, inverse)


@moe_combine_grad_probs.register_fake
def _(grad, y, inverse):
    return empty_on(y, inverse.shape, torch.float32)
