"""The MoE router's choice in one pass: softmax over the experts, the top ``k``, renormalized; and its gradient.

For router logits ``z (T, E)``, each token's row::

    p   = softmax(z)                       (float32)
    e_j = the j-th largest p               (j = 0 .. k-1; equal values: the lower expert first)
    w_j = p[e_j] / S,   S = sum_j p[e_j]

``router_topk`` returns ``(w (T, k) float32, e (T, k) int64)``. Its gradient, given
``gw = dL/dw``, with ``v_j = p[e_j]``::

    gv_j   = (gw_j - W) / S,   W = sum_i gw_i w_i
    dL/dz  = p * (gp - sum_j gv_j v_j) = p * gp,    gp = gv_j at column e_j, 0 elsewhere

(``sum_j gv_j v_j = (sum_j gw_j v_j) / S - W = 0``: softmax's shift term vanishes.)

``router_topk_backward`` recomputes ``p`` from ``z`` (the logits are kept for backward
anyway: the router's output) and returns ``dL/dz`` in ``z``'s dtype.

In PyTorch (``softmax(z.float()).topk(k)``, then the sum and the division) this is a
float32 copy of the logits, softmax, a top-k (``torch.topk``'s kernel took 215 us for
32768 x 128 on the H200, most of the router's time), a sum and a division forward,
and as many passes plus a scatter into a ``(T, E)`` zero tensor backward. Here each
program holds whole rows (``E`` up to a few hundred) and each pass reads ``z`` once.

NaN in a row's logits makes its whole ``p`` NaN (as softmax does), hence its ``w`` and
its gradient; its experts are then any in ``[0, E)``, never out of range.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.group_offsets import group_lanes
from kernels_helion.validation import check_same_device, check_tensor
from kernels_helion.tuning import random_bf16, vary

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# block_sizes = [tokens] per program (each program holds its tokens' whole rows).
DEFAULT_CONFIG = helion.Config(block_sizes=[16], num_warps=4, num_stages=1)
BACKWARD_DEFAULT_CONFIG = helion.Config(block_sizes=[16], num_warps=4, num_stages=1)


def softmax_rows(logits: torch.Tensor, tile_t: hl.Tile, cols: torch.Tensor, in_row: torch.Tensor) -> torch.Tensor:
    """Device side: float32 ``softmax`` of the tile's rows over the ``E`` experts (0 in the padding columns)."""
    z = hl.load(logits, [tile_t, cols], extra_mask=in_row).to(torch.float32)
    z = torch.where(in_row, z, float("-inf"))
    shifted = z - torch.amax(z, dim=1, keepdim=True)
    # tl.exp (Helion lowers torch.exp to libdevice's, which Triton's CPU interpreter cannot run).
    e = hl.inline_triton("tl.exp({0})", args=(shifted,), output_like=shifted)
    return e / torch.sum(e, dim=1, keepdim=True)


@helion.kernel(static_shapes=False)
def router_topk_kernel(
    logits: torch.Tensor, top_k: hl.constexpr, experts_pow2: hl.constexpr, k_pow2: hl.constexpr
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, e)`` of the module docstring: ``(T, k)`` float32 and int64."""
    tokens, num_experts = logits.shape
    weights = torch.empty([tokens, top_k], dtype=torch.float32, device=logits.device)
    experts = torch.empty([tokens, top_k], dtype=torch.int64, device=logits.device)
    for tile_t in hl.tile(tokens):
        cols = hl.arange(experts_pow2)
        in_row = (cols < num_experts)[None, :]
        p = softmax_rows(logits, tile_t, cols, in_row)
        picks = hl.arange(k_pow2)
        candidates = torch.where(in_row, p, float("-inf"))
        values = hl.zeros([tile_t, k_pow2], dtype=torch.float32)
        chosen = hl.zeros([tile_t, k_pow2], dtype=torch.int64)
        for j in hl.static_range(top_k):
            best = torch.amax(candidates, dim=1)
            # The first column holding the maximum; a NaN row (no column equals it) takes column 0.
            hit = (candidates == best[:, None]) | (best != best)[:, None]
            first = torch.amin(torch.where(hit, cols[None, :], experts_pow2), dim=1)
            first = torch.where(first < num_experts, first, 0)
            values = torch.where((picks == j)[None, :], best[:, None], values)
            chosen = torch.where((picks == j)[None, :], first[:, None].to(torch.int64), chosen)
            candidates = torch.where(cols[None, :] == first[:, None], float("-inf"), candidates)
        in_k = (picks < top_k)[None, :]
        total = torch.sum(values, dim=1)
        hl.store(weights, [tile_t, picks], values / total[:, None], extra_mask=in_k)
        hl.store(experts, [tile_t, picks], chosen, extra_mask=in_k)
    return weights, experts


@helion.kernel(static_shapes=False)
def router_topk_backward_kernel(
    logits: torch.Tensor,
    experts: torch.Tensor,
    grad_weights: torch.Tensor,
    top_k: hl.constexpr,
    experts_pow2: hl.constexpr,
) -> torch.Tensor:
    """``dL/dz (T, E)`` in ``logits``' dtype, from ``dL/dw (T, k)`` and the chosen experts."""
    tokens, num_experts = logits.shape
    grad_logits = torch.empty([tokens, num_experts], dtype=logits.dtype, device=logits.device)
    for tile_t in hl.tile(tokens):
        cols = hl.arange(experts_pow2)
        in_row = (cols < num_experts)[None, :]
        p = softmax_rows(logits, tile_t, cols, in_row)
        # S, S * W and gw at each chosen column, the chosen values read back from p.
        total = hl.zeros([tile_t], dtype=torch.float32)
        weighted = hl.zeros([tile_t], dtype=torch.float32)
        grad_at = hl.zeros([tile_t, experts_pow2], dtype=torch.float32)
        chosen = hl.zeros([tile_t, experts_pow2], dtype=torch.float32)
        for j in hl.static_range(top_k):
            hit = cols[None, :] == experts[tile_t, j][:, None]
            grad_w = grad_weights[tile_t, j].to(torch.float32)
            v = torch.sum(torch.where(hit, p, 0.0), dim=1)
            total = total + v
            weighted = weighted + grad_w * v
            grad_at = torch.where(hit, grad_w[:, None], grad_at)
            chosen = torch.where(hit, 1.0, chosen)
        # p * gp, gp = (gw_j - W) / S at the chosen columns.
        grad_p = (grad_at - chosen * (weighted / total)[:, None]) / total[:, None]
        hl.store(grad_logits, [tile_t, cols], (p * grad_p).to(logits.dtype), extra_mask=in_row)
    return grad_logits


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=LOGIT_DTYPES)
    if not isinstance(top_k, int) or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be an int in [1, E = {logits.shape[1]}] (logits' columns), got {top_k!r}")


def router_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the ``top_k`` largest, renormalized over them: the MoE router's choice.

    Args:
        logits: ``(T, E)`` bf16 / fp16 / fp32, contiguous: the router's output.
        top_k: the experts per token, ``1 <= top_k <= E``.

    Returns:
        ``(weights, experts)``: ``(T, top_k)`` float32 weights summing to 1 per token, and
        ``(T, top_k)`` int64 experts in descending order of probability (equal values: the lower
        expert first). The same as ``p = softmax(logits.float(), -1); v, e = p.topk(top_k);
        v / v.sum(-1, keepdim=True)`` up to float32 rounding.
    """
    _check_logits(logits, top_k)
    require_interpreter_on_cpu(logits)
    tokens, num_experts = logits.shape
    if tokens == 0:
        return (torch.empty((0, top_k), dtype=torch.float32, device=logits.device),
                torch.empty((0, top_k), dtype=torch.int64, device=logits.device))
    config = select_config("router_topk", {"T": tokens, "E": num_experts, "k": top_k}, DEFAULT_CONFIG)
    return launch(router_topk_kernel, (logits, top_k, group_lanes(num_experts), group_lanes(top_k)), config)


def router_topk_backward(logits: torch.Tensor, experts: torch.Tensor, grad_weights: torch.Tensor) -> torch.Tensor:
    """``router_topk``'s gradient for ``logits``, ``(T, E)`` in ``logits``' dtype.

    Args:
        logits: ``router_topk``'s input.
        experts: ``(T, k)`` int64: its chosen experts.
        grad_weights: ``(T, k)`` float32 (or bf16 / fp16), contiguous: the gradient of its weights.
    """
    check_tensor("experts", experts, ndim=2, dtypes=(torch.int64,))
    _check_logits(logits, experts.shape[1])
    check_tensor("grad_weights", grad_weights, ndim=2, dtypes=LOGIT_DTYPES)
    if experts.shape[0] != logits.shape[0] or grad_weights.shape != experts.shape:
        raise ValueError(
            f"experts and grad_weights must be (T, k) with T = {logits.shape[0]} (logits' rows); got experts "
            f"{tuple(experts.shape)}, grad_weights {tuple(grad_weights.shape)}"
        )
    check_same_device("experts", experts, logits.device)
    check_same_device("grad_weights", grad_weights, logits.device)
    require_interpreter_on_cpu(logits)
    tokens, num_experts = logits.shape
    top_k = experts.shape[1]
    if tokens == 0:
        return torch.empty_like(logits)
    config = select_config("router_topk_backward", {"T": tokens, "E": num_experts, "k": top_k}, BACKWARD_DEFAULT_CONFIG)
    return launch(router_topk_backward_kernel, (logits, experts, grad_weights, top_k, group_lanes(num_experts)), config)


# Tuning: Qwen3-30B-A3B's router (128 experts, top-8) and DeepSeek-V3's (256, top-8), 8192 to 32768 tokens.
TUNING_SHAPES = [{"T": t, "E": e, "k": 8} for t in (8192, 32768) for e in (128, 256)]


def _tuning_call(name: str) -> Callable[[dict[str, int], torch.device], Callable[[], object]]:
    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        logits = random_bf16(shape["T"], shape["E"], device=device)
        if name == "router_topk":
            return lambda: router_topk(logits, shape["k"])
        _, experts = router_topk(logits, shape["k"])
        grad = torch.randn(shape["T"], shape["k"], device=device)
        return lambda: router_topk_backward(logits, experts, grad)

    return make_call


def _space(default: helion.Config) -> Callable[[str], list[helion.Config]]:
    return lambda arch: vary(default, block_sizes=[[t] for t in (4, 8, 16, 32)], num_warps=[1, 2, 4])


# A row's sums run in an order that follows the layout (num_warps): configs agree to rounding.
for _name, _default in (("router_topk", DEFAULT_CONFIG), ("router_topk_backward", BACKWARD_DEFAULT_CONFIG)):
    register_tuning(_name, _default, _space(_default), TUNING_SHAPES, _tuning_call(_name), {"T": 13, "E": 40, "k": 3},
                    exact=False)
