"""A torchtitan-like MoE layer: router, top-k, token permutation, SwiGLU experts, weighted combine.

    moe = ops.MoE(dim, hidden_dim, num_experts, top_k)    # experts: ops.GroupedExperts
    ops.convert_to_fp8(moe)                                # FP8 experts
    ops.apply_expert_parallel(moe, mesh)                   # experts sharded over a mesh dim

The experts are called as torchtitan calls them, ``experts(x_sorted,
num_tokens_per_expert)``: ``x_sorted`` holds one row per (token, choice) pair,
ordered by expert (stable, so tokens keep their order within an expert), and
``num_tokens_per_expert`` counts them for every expert of the layer. Expert
parallelism (``ops.expert_parallel``) hooks into that call; the layer itself is
the same with and without it.

Every reordering is a gather by a permutation, and its gradient the gather by
the inverse permutation (no scatter), and the top-k sums run over a fixed axis,
so forward and backward are bitwise reproducible on GPUs too (no atomic
accumulation of several rows into one). Nothing syncs with the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

import ops.custom_ops_moe  # noqa: F401  (defines the fp8moe router and combine ops used below)
from ops.ep_layout import TokenRows
from ops.grouped_linear_autograd import CombineRouting
from ops.modules import GroupedExperts
from ops.op_registry import kernel_ops
from ops.row_gather import gather_rows, sum_pair_rows


class ExpertOrder(NamedTuple):
    """The (token, choice) pairs of a batch sorted by expert."""

    order: Tensor  # (T * k,) int64: sorted position -> pair index (token * k + choice)
    inverse: Tensor  # (T * k,) int64: pair index -> sorted position
    num_tokens_per_expert: Tensor  # (E,) int64


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def sort_by_expert(top_experts: Tensor, num_experts: int) -> ExpertOrder:
    """Sort the pairs of ``top_experts (T, k)`` by expert, stably; count the pairs of each expert.

    Indices outside ``[0, num_experts)`` are counted nowhere: their pairs sit past
    the counted rows. Checking their values would sync with the host, so on one
    device nothing reports them (``ops.MoE``'s top-k never makes them; rows past the
    counted ones get no expert: 0 from our FP8 experts, unspecified from
    ``torch._grouped_mm``); ``ops.expert_parallel`` detects them on every rank.
    """
    if not isinstance(top_experts, Tensor) or top_experts.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"top_experts must be a tensor of integer expert indices ({', '.join(map(str, _INDEX_DTYPES))}), got "
            f"{top_experts.dtype if isinstance(top_experts, Tensor) else type(top_experts).__name__}"
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, torch.SymInt)) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    experts = top_experts.flatten()
    in_range = (experts >= 0) & (experts < num_experts)
    # One bin past the last expert takes the out-of-range pairs: sorted after every expert's rows,
    # counted nowhere. The keys are as narrow as the bins allow: the GPU's radix sort runs one pass
    # per key byte (8 for int64 keys).
    key_dtype = torch.int16 if num_experts < 2**15 - 1 else torch.int32
    bins = torch.where(in_range, experts, num_experts).to(key_dtype)
    sorted_bins, order = torch.sort(bins, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # Each expert's rows end where the sorted bins pass it: a search of the sorted keys, with no
    # atomic count (a scatter-add of T * k ones into E counters serializes on them) and no host
    # sync (torch.bincount's).
    ends = torch.searchsorted(sorted_bins, torch.arange(num_experts, dtype=key_dtype, device=bins.device), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return ExpertOrder(order, inverse, counts)


class _RowsOfPairs(torch.autograd.Function):
    """``x[order // k]``: each token's row once per choice, in sorted order.

    Backward sums each token's ``k`` pair gradients (``sum_pair_rows``): a fixed
    reduction, where ``index_add`` of repeated rows would add them atomically in a
    varying order on GPUs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, order: ExpertOrder, top_k: int) -> Tensor:
        ctx.inverse, ctx.top_k = order.inverse, top_k
        return gather_rows(x, order.order // top_k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return sum_pair_rows(grad.contiguous(), ctx.inverse.view(-1, ctx.top_k)), None, None


def rows_of_pairs(x: Tensor, order: ExpertOrder, top_k: int) -> Tensor:
    """``x[order // k]``: each token's row of ``x (T, dim)`` once per choice, in sorted order, ``(T * k, dim)``.

    Differentiable; backward sums each token's ``k`` pair gradients in a fixed order.
    """
    return _RowsOfPairs.apply(x, order, top_k)


class _CombinePairs(torch.autograd.Function):
    """``sum_j top_probs[t, j] * y[pair (t, j)]`` in float32 (``kernels_helion.moe_combine``), and its gradients.

    The kernels gather the pairs' rows themselves: no ``(T, k, dim)`` float32 copy
    of the pairs is made, forward or backward, and only ``y_sorted`` is kept for
    backward. Backward gathers (no scatter): ``dy`` by the permutation, the
    probabilities' gradient as one dot product per pair.
    """

    @staticmethod
    def forward(ctx, y_sorted: Tensor, order: ExpertOrder, top_probs: Tensor) -> Tensor:
        tokens, top_k = top_probs.shape
        y_sorted, top_probs = y_sorted.contiguous(), top_probs.contiguous()
        inverse = order.inverse.view(tokens, top_k)
        ctx.save_for_backward(y_sorted, top_probs)
        ctx.order = order
        return kernel_ops.moe_combine(y_sorted, inverse, top_probs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        y_sorted, top_probs = ctx.saved_tensors
        order = ctx.order
        grad = grad.contiguous()
        grad_y = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_y = kernel_ops.moe_combine_grad_rows(grad, order.order, top_probs)
        if ctx.needs_input_grad[2]:
            inverse = order.inverse.view(top_probs.shape)
            grad_probs = kernel_ops.moe_combine_grad_probs(grad, y_sorted, inverse).to(top_probs.dtype)
        return grad_y, None, grad_probs


def combine_pairs(y_sorted: Tensor, order: ExpertOrder, top_probs: Tensor) -> Tensor:
    """``sum_j top_probs[t, j] * y[pair (t, j)]``: the experts' rows back in token order, weighted and summed.

    Accumulated in float32 and returned in ``y_sorted``'s dtype, ``(T, dim)``.
    """
    return _CombinePairs.apply(y_sorted, order, top_probs)


class _RouterTopK(torch.autograd.Function):
    """Softmax, top-k and renormalization of the router's logits (``kernels_helion.router_topk``).

    Backward recomputes the softmax from the logits (kept: the router's output) and the chosen
    experts; it writes the logits' gradient in one pass (no ``(T, E)`` float32 intermediates).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
        logits = logits.contiguous()
        weights, experts = kernel_ops.router_topk(logits, top_k)
        ctx.save_for_backward(logits, experts)
        ctx.mark_non_differentiable(experts)
        return weights, experts

    @staticmethod
    def backward(ctx, grad_weights: Tensor | None, _grad_experts: None) -> tuple[Tensor | None, None]:
        logits, experts = ctx.saved_tensors
        if grad_weights is None:
            return None, None
        return kernel_ops.router_topk_backward(logits, experts, grad_weights.contiguous()), None


def router_topk(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The router's choice: ``(weights (T, k) float32, experts (T, k) int64)`` of ``logits (T, E)``.

    ``softmax(logits)`` over the experts in float32, the ``top_k`` largest (equal values: the
    lower expert first), renormalized to sum to 1: ``p.topk(k)`` then ``v / v.sum(-1)`` up to
    float32 rounding, in one kernel each way. Differentiable in ``logits``.
    """
    return _RouterTopK.apply(logits, top_k)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, ``(..., dim) -> (..., dim)``, torchtitan's layout and experts call.

    ``router``: ``nn.Linear(dim, num_experts)``; softmax scores, top-k, renormalized
    over the k choices. ``experts``: ``ops.GroupedExperts`` (``ops.convert_to_fp8``
    swaps it for ``ops.Fp8GroupedExperts``; any module called as
    ``experts(x_sorted, num_tokens_per_expert)`` works).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, dtype=dtype, device=device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(top_probs (T, k) float32, top_experts (T, k) int64)`` of ``x (T, dim)`` (``router_topk``)."""
        return router_topk(self.router(x), self.top_k)

    def apply_experts(self, x: Tensor, top_probs: Tensor, top_experts: Tensor) -> Tensor:
        """The layer for a given routing: ``x (T, dim)``, ``top_probs``/``top_experts (T, k)`` -> ``(T, dim)``.

        An expert may appear several times in a token's row of ``top_experts``.
        """
        order = sort_by_expert(top_experts, self.num_experts)
        top_k = top_experts.shape[1]
        if getattr(self.experts, "expert_parallel", None) is not None:
            # The dispatch gathers each pair's token row into its send buffer: no (T * k, dim) copy of x.
            tokens = TokenRows(order.order // top_k, order.inverse.view(-1, top_k))
            y_sorted = self.experts(x, order.num_tokens_per_expert, tokens=tokens)
        elif getattr(self.experts, "takes_routed_tokens", False):
            # The experts read each pair's token row by index: no (T * k, dim) copy of x (row-major: a
            # strided view is copied once).
            x = x.contiguous()
            rows, inverse = (order.order // top_k).to(torch.int32), order.inverse.view(-1, top_k)
            if getattr(self.experts, "takes_combine", False):
                # The combine runs with the down-projection: its gradient rows are read by index in backward.
                combine = (CombineRouting(order.order, inverse, rows), top_probs)
                return self.experts(x, order.num_tokens_per_expert, routing=(rows, inverse), combine=combine)
            y_sorted = self.experts(x, order.num_tokens_per_expert, routing=(rows, inverse))
        else:
            x_sorted = rows_of_pairs(x, order, top_k)
            y_sorted = self.experts(x_sorted, order.num_tokens_per_expert)
        return combine_pairs(y_sorted, order, top_probs)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        top_probs, top_experts = self.route(tokens)
        out = self.apply_experts(tokens, top_probs, top_experts)
        # Not a view when x is (T, dim): FSDP2 warns of a wrapped module that returns one.
        return out if x.dim() == 2 else out.view(x.shape)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}"
