"""What an experts module is, and the names of its weights: the one definition ``ops`` reads.

An experts module holds SwiGLU experts in torchtitan's layout, three 3-D parameters
``w1 (E, hidden, dim)``, ``w2 (E, dim, hidden)``, ``w3 (E, hidden, dim)``, and is
called as ``experts(x_sorted, num_tokens_per_expert)``. ``ops.GroupedExperts`` is
one; any module that fits is one too (``ops.convert_to_fp8`` converts it,
``ops.apply_expert_parallel`` shards it). A grouped linear (``ops.GroupedLinear``)
holds one expert weight, ``weight (E, N, K)``.
"""

from __future__ import annotations

from torch import nn

EXPERT_WEIGHTS: tuple[str, ...] = ("w1", "w2", "w3")
"""An experts module's weights, in the order ``w1``, ``w2``, ``w3``."""

GROUPED_LINEAR_WEIGHTS: tuple[str, ...] = ("weight",)
"""A grouped linear's weight."""


def expert_weights(module: nn.Module) -> tuple[nn.Parameter, ...] | None:
    """``module``'s ``(w1, w2, w3)`` if it is an experts module (see the module docstring), else ``None``."""
    params = tuple(getattr(module, name, None) for name in EXPERT_WEIGHTS)
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params):
        return None
    w1, w2, w3 = params
    e, hidden, dim = w1.shape
    if tuple(w3.shape) != (e, hidden, dim) or tuple(w2.shape) != (e, dim, hidden):
        return None
    return params


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module: 3-D ``w1 (E, H, D)``, ``w2 (E, D, H)``, ``w3 (E, H, D)`` parameters."""
    return expert_weights(module) is not None
