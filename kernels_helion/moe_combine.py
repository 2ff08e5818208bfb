"""The MoE layer's combine: each token's ``k`` expert rows, weighted by its routing probabilities and summed.

With ``y (R, D)`` the experts' output rows in sorted (expert-major) order,
``inverse (T, k)`` the sorted position of each (token, choice) pair and
``probs (T, k)`` the routing weights::

    forward     out[t]            = sum_j probs[t, j] * y[inverse[t, j]]      (float32, j = 0 .. k-1)
    backward    grad_y[s]         = grad[t] * probs[t, j]                     (s = inverse[t, j])
                grad_probs[t, j]  = sum_d grad[t, d] * y[inverse[t, j], d]    (float32)

Written as PyTorch expressions, these gather the ``(T, k, D)`` pairs and convert
them to float32 (four bytes per value, written and read again by the product and
the sum), forward and again in backward. Each kernel here reads every row it
needs once and writes only its result: at DeepSeek-V3's width (D = 7168, k = 8)
the float32 pairs of one 8192-token batch are 1.9 GB.

Every output element is computed by one program in a fixed order (no atomics), so
results are bitwise reproducible. ``grad_y`` is the same single float32 product,
rounded once, as the expression's. Indices outside ``[0, R)`` load zeros (the
callers pass permutations: ``ops.sort_by_expert``'s).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.validation import check_tensor
from kernels_helion.tuning import random_bf16, vary

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# block_sizes = [tokens, columns] per program.
COMBINE_DEFAULT_CONFIG = helion.Config(block_sizes=[16, 256], num_warps=4, num_stages=1)
# block_sizes = [sorted rows, columns] per program.
GRAD_ROWS_DEFAULT_CONFIG = helion.Config(block_sizes=[16, 256], num_warps=4, num_stages=1)
# block_sizes = [pairs, columns] per program (the columns are the reduction's steps).
GRAD_PROBS_DEFAULT_CONFIG = helion.Config(block_sizes=[32, 256], num_warps=4, num_stages=2)


@helion.kernel(static_shapes=False)
def moe_combine_kernel(y: torch.Tensor, inverse: torch.Tensor, probs: torch.Tensor, top_k: hl.constexpr) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * y[inverse[t, j]]``, accumulated in float32, stored in ``y``'s dtype."""
    rows, dim = y.shape
    tokens = probs.size(0)
    out = torch.empty([tokens, dim], dtype=y.dtype, device=y.device)
    for tile_t, tile_d in hl.tile([tokens, dim]):
        acc = hl.zeros([tile_t, tile_d], dtype=torch.float32)
        for j in hl.static_range(top_k):
            source = inverse[tile_t, j]
            valid = (source >= 0) & (source < rows)
            values = hl.load(y, [source, tile_d], extra_mask=valid[:, None]).to(torch.float32)
            acc = acc + values * probs[tile_t, j].to(torch.float32)[:, None]
        out[tile_t, tile_d] = acc.to(out.dtype)
    return out


@helion.kernel(static_shapes=False)
def moe_combine_grad_rows_kernel(
    grad: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, top_k: hl.constexpr
) -> torch.Tensor:
    """``grad_y[s] = grad[p // k] * probs[p]`` for the pair ``p = order[s]`` (``probs`` flat, ``(T * k,)``)."""
    tokens, dim = grad.shape
    rows = order.size(0)
    out = torch.empty([rows, dim], dtype=grad.dtype, device=grad.device)
    for tile_s, tile_d in hl.tile([rows, dim]):
        pair = order[tile_s]
        valid = (pair >= 0) & (pair < tokens * top_k)
        weight = hl.load(probs, [pair], extra_mask=valid).to(torch.float32)
        values = hl.load(grad, [pair // top_k, tile_d], extra_mask=valid[:, None]).to(torch.float32)
        out[tile_s, tile_d] = (values * weight[:, None]).to(out.dtype)
    return out


@helion.kernel(static_shapes=False)
def moe_combine_grad_probs_kernel(
    grad: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, top_k: hl.constexpr
) -> torch.Tensor:
    """``grad_probs[p] = sum_d grad[p // k, d] * y[inverse[p], d]`` in float32 (``inverse`` flat, ``(T * k,)``)."""
    rows, dim = y.shape
    pairs = inverse.size(0)
    out = torch.empty([pairs], dtype=torch.float32, device=y.device)
    for tile_p in hl.tile(pairs):
        source = inverse[tile_p]
        valid = (source >= 0) & (source < rows)
        token = tile_p.index // top_k
        acc = hl.zeros([tile_p], dtype=torch.float32)
        for tile_d in hl.tile(dim):
            g = grad[token, tile_d].to(torch.float32)
            values = hl.load(y, [source, tile_d], extra_mask=valid[:, None]).to(torch.float32)
            acc = acc + torch.sum(g * values, dim=1)
        out[tile_p] = acc
    return out


PROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_routing(inverse: torch.Tensor, probs: torch.Tensor, device: torch.device) -> None:
    check_tensor("inverse", inverse, ndim=2, dtypes=(torch.int64,))
    check_tensor("probs", probs, ndim=2, dtypes=PROBS_DTYPES)
    if inverse.shape != probs.shape:
        raise ValueError(f"inverse and probs must have the same (tokens, k) shape, got {tuple(inverse.shape)} and {tuple(probs.shape)}")
    _check_device(device, inverse=inverse, probs=probs)


def moe_combine(y: torch.Tensor, inverse: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' rows back in token order, weighted and summed over each token's ``k`` choices.

    Args:
        y: ``(T * k, D)`` bf16 / fp16 / fp32, contiguous: the experts' output rows, sorted by expert.
        inverse: ``(T, k)`` int64: the row of ``y`` holding pair ``(t, j)`` (a permutation of ``[0, T * k)``).
        probs: ``(T, k)`` float32 (or bf16 / fp16): the routing weights.

    Returns:
        ``(T, D)`` of ``y``'s dtype: ``sum_j probs[t, j] * y[inverse[t, j]]``, accumulated in float32
        in the order ``j = 0 .. k-1``.
    """
    check_tensor("y", y, ndim=2, dtypes=ROW_DTYPES)
    _check_routing(inverse, probs, y.device)
    tokens, top_k = probs.shape
    if y.shape[0] != tokens * top_k:
        raise ValueError(f"y must have tokens * k = {tokens * top_k} rows (one per pair), got {y.shape[0]}")
    require_interpreter_on_cpu(y)
    dim = y.shape[1]
    if tokens == 0 or dim == 0 or top_k == 0:
        return torch.zeros((tokens, dim), dtype=y.dtype, device=y.device)
    config = select_config("moe_combine", {"T": tokens, "D": dim, "k": top_k}, COMBINE_DEFAULT_CONFIG)
    return launch(moe_combine_kernel, (y, inverse, probs, top_k), config)


def _check_backward(grad: torch.Tensor, y: torch.Tensor, index: torch.Tensor, routing: torch.Tensor) -> None:
    """Checks shared by the backward launchers: ``grad (T, D)``, ``y (T * k, D)``, ``index (T * k,)``;
    ``routing`` is the call's ``(T, k)`` tensor (already checked)."""
    check_tensor("y", y, ndim=2, dtypes=ROW_DTYPES)
    check_tensor("grad", grad, ndim=2, dtypes=(y.dtype,))
    tokens, top_k = routing.shape
    if grad.shape != (tokens, y.shape[1]) or y.shape[0] != tokens * top_k or index.shape != (tokens * top_k,):
        raise ValueError(
            f"grad must be (T, D) = {(tokens, y.shape[1])} and y {tokens * top_k} rows (T * k), the pair index "
            f"({tokens * top_k},); got grad {tuple(grad.shape)}, y {tuple(y.shape)}, index {tuple(index.shape)}"
        )
    _check_device(y.device, grad=grad)
    require_interpreter_on_cpu(y)


def moe_combine_grad_rows(grad: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``moe_combine``'s gradient for ``y``: ``grad[t] * probs[t, j]`` (one float32 product) at the row of pair ``(t, j)``.

    Args:
        grad: ``(T, D)`` bf16 / fp16 / fp32, contiguous: the output's gradient.
        order: ``(T * k,)`` int64: the pair ``t * k + j`` held by each row of ``y`` (``inverse``'s
            inverse permutation).
        probs: ``(T, k)``: ``moe_combine``'s routing weights.

    Returns:
        ``(T * k, D)`` of ``grad``'s dtype.
    """
    check_tensor("grad", grad, ndim=2, dtypes=ROW_DTYPES)
    check_tensor("order", order, ndim=1, dtypes=(torch.int64,))
    check_tensor("probs", probs, ndim=2, dtypes=PROBS_DTYPES)
    _check_device(grad.device, order=order, probs=probs)
    tokens, top_k = probs.shape
    if grad.shape[0] != tokens or order.shape != (tokens * top_k,):
        raise ValueError(
            f"grad must be (T, D) with T = {tokens} (probs' rows) and order ({tokens * top_k},) (T * k); got grad "
            f"{tuple(grad.shape)}, order {tuple(order.shape)}"
        )
    require_interpreter_on_cpu(grad)
    if grad.numel() == 0 or top_k == 0:
        return torch.zeros((tokens * top_k, grad.shape[1]), dtype=grad.dtype, device=grad.device)
    config = select_config("moe_combine_grad_rows", {"T": tokens, "D": grad.shape[1], "k": top_k}, GRAD_ROWS_DEFAULT_CONFIG)
    return launch(moe_combine_grad_rows_kernel, (grad, order, probs.view(-1), top_k), config)


def moe_combine_grad_probs(grad: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``moe_combine``'s gradient for ``probs``: the float32 dot product of ``grad[t]`` and ``y[inverse[t, j]]``.

    Args:
        grad: ``(T, D)`` of ``y``'s dtype, contiguous: the output's gradient.
        y, inverse: ``moe_combine``'s arguments.

    Returns:
        ``(T, k)`` float32.
    """
    check_tensor("inverse", inverse, ndim=2, dtypes=(torch.int64,))
    _check_device(y.device, inverse=inverse)
    _check_backward(grad, y, inverse.view(-1), inverse)
    tokens, top_k = inverse.shape
    if grad.numel() == 0 or top_k == 0:
        return torch.zeros((tokens, top_k), dtype=torch.float32, device=y.device)
    config = select_config("moe_combine_grad_probs", {"T": tokens, "D": grad.shape[1], "k": top_k}, GRAD_PROBS_DEFAULT_CONFIG)
    return launch(moe_combine_grad_probs_kernel, (grad, y, inverse.view(-1), top_k), config).view(tokens, top_k)


# Tuning: at Qwen3-30B-A3B's and DeepSeek-V3's widths, top-8, 8192 to 32768 tokens (the MoE layer benchmark's).
TUNING_SHAPES = [{"T": t, "D": d, "k": 8} for t in (8192, 16384, 32768) for d in (2048, 7168)]


def _register_tuning(name: str, default: helion.Config) -> None:
    """The combine or one of its two gradients."""

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        tokens, top_k = shape["T"], shape["k"]
        y = random_bf16(tokens * top_k, shape["D"], device=device)
        grad = random_bf16(tokens, shape["D"], device=device)
        order = torch.randperm(tokens * top_k, device=device)
        inverse = torch.argsort(order).view(tokens, top_k)
        probs = torch.rand(tokens, top_k, device=device)
        if name == "moe_combine":
            return lambda: moe_combine(y, inverse, probs)
        if name == "moe_combine_grad_rows":
            return lambda: moe_combine_grad_rows(grad, order, probs)
        return lambda: moe_combine_grad_probs(grad, y, inverse)

    def space(arch: str) -> list[helion.Config]:
        rows = [8, 16, 32] if name != "moe_combine_grad_probs" else [16, 32, 64]
        return vary(default, block_sizes=[[r, c] for r in rows for c in (256, 512)], num_warps=[4, 8])

    # grad_probs sums over D in column tiles: another tile width sums in another order.
    register_tuning(name, default, space, TUNING_SHAPES, make_call, {"T": 13, "D": 40, "k": 3},
                    exact=name != "moe_combine_grad_probs")


_register_tuning("moe_combine", COMBINE_DEFAULT_CONFIG)
_register_tuning("moe_combine_grad_rows", GRAD_ROWS_DEFAULT_CONFIG)
_register_tuning("moe_combine_grad_probs", GRAD_PROBS_DEFAULT_CONFIG)
