"""The router's top-k kernels (``kernels_helion.router_topk``) and ``ops.router_topk`` against autograd of the
plain expression: ``softmax(z.float())``, ``topk``, renormalization."""

from __future__ import annotations

import pytest
import torch

import kernels_helion as kernels
import ops
from tests.support import DEVICE, opcheck_fp8

# The weights to float32 rounding: a few ulps apart from torch's (the kernel's exp is Triton's, on GPUs an
# approximate exp2, and its sums run in another order).
WEIGHT_RTOL, WEIGHT_ATOL = 4e-6, 1e-7


def _plain(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    values, experts = probs.topk(top_k, dim=-1)
    return values / values.sum(dim=-1, keepdim=True), experts


def _separated_logits(tokens: int, num_experts: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits whose probabilities differ by far more than rounding: every top-k choice is unambiguous."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ranks = torch.rand(tokens, num_experts, device=DEVICE, generator=gen).argsort(dim=-1).float()
    return (ranks * (4.0 / max(num_experts, 1)) - 2.0).to(dtype)


@pytest.mark.parametrize(
    "tokens, num_experts, top_k",
    # unaligned E and k; k = 1; k = E; E past one 128-wide block; Qwen3's router
    [(37, 40, 3), (5, 7, 1), (9, 6, 6), (20, 160, 8), (64, 128, 8)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_topk_matches_autograd_of_the_plain_expression(tokens, num_experts, top_k, dtype):
    """Experts exactly; weights and the logits' gradient to float32 rounding (the logits' dtype for the gradient)."""
    logits = _separated_logits(tokens, num_experts, seed=tokens + num_experts, dtype=dtype)
    grad = torch.randn(tokens, top_k, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    results = []
    for fn in (_plain, ops.router_topk):
        z = logits.clone().requires_grad_()
        weights, experts = fn(z, top_k)
        weights.backward(grad)
        results.append((weights, experts, z.grad))
    (w_ref, e_ref, g_ref), (w, e, g) = results
    assert e.dtype == torch.int64 and w.dtype == torch.float32 and g.dtype == dtype
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    torch.testing.assert_close(w.sum(-1), torch.ones(tokens, device=DEVICE), rtol=WEIGHT_RTOL, atol=WEIGHT_RTOL)
    # Float32 rounding of products of |grad| ~ 1 (k = 1: the true gradient is 0, both are rounding noise),
    # then one rounding to the logits' dtype.
    atol = 1e-6 + (2.0**-7 * g_ref.abs().max().item() if dtype == torch.bfloat16 else 0.0)
    torch.testing.assert_close(g, g_ref, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5, atol=atol)
    # The gradient of renormalized weights sums to 0 over each row's logits (up to rounding).
    assert g.float().sum(-1).abs().max() <= 1e-2 * g_ref.abs().max().item() + 1e-5
    # Deterministic: a second run is bitwise the same.
    z = logits.clone().requires_grad_()
    again, experts_again = ops.router_topk(z, top_k)
    again.backward(grad)
    assert torch.equal(again, w) and torch.equal(experts_again, e) and torch.equal(z.grad, g)


def test_router_topk_takes_the_lower_expert_among_equal_probabilities():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = 1.0  # one larger, then seven equal
    logits[2, 2] = logits[2, 6] = 1.0
    weights, experts = kernels.router_topk(logits, 3)
    assert experts.tolist() == [[0, 1, 2], [5, 0, 1], [2, 6, 0]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))


def test_router_topk_propagates_nan_to_its_row_only():
    """A NaN logit makes its token's weights and logits' gradient NaN (softmax's row is NaN); its experts stay in
    range, and the other rows are those of the rows alone."""
    logits = _separated_logits(6, 12, seed=3, dtype=torch.bfloat16)
    logits[2, 7] = float("nan")
    z = logits.clone().requires_grad_()
    weights, experts = ops.router_topk(z, 4)
    weights.backward(torch.ones_like(weights) + torch.arange(4, device=DEVICE))
    assert weights[2].isnan().all() and z.grad[2].isnan().all()
    assert ((experts >= 0) & (experts < 12)).all()
    rows = [0, 1, 3, 4, 5]
    assert not weights[rows].isnan().any() and not z.grad[rows].isnan().any()
    alone, experts_alone = kernels.router_topk(logits[rows].contiguous(), 4)
    assert torch.equal(alone, weights[rows]) and torch.equal(experts_alone, experts[rows])


def test_router_topk_no_tokens_and_only_the_experts_used():
    z = torch.zeros(0, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weights, experts = ops.router_topk(z, 2)
    weights.sum().backward()
    assert weights.shape == experts.shape == (0, 2) and z.grad.shape == (0, 16)
    # The experts are not differentiable.
    z = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    _, experts = ops.router_topk(z, 2)
    assert not experts.requires_grad


def test_router_topk_bad_input():
    logits = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be an int in \\[1, E = 8\\]"):
        kernels.router_topk(logits, 9)
    with pytest.raises(ValueError, match="top_k must be an int in \\[1, E = 8\\]"):
        kernels.router_topk(logits, 0)
    with pytest.raises(TypeError, match="logits must have dtype"):
        kernels.router_topk(logits.to(torch.int32), 2)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        kernels.router_topk(logits.view(2, 2, 8), 2)
    _, experts = kernels.router_topk(logits, 2)
    with pytest.raises(ValueError, match="experts and grad_weights must be \\(T, k\\) with T = 4"):
        kernels.router_topk_backward(logits, experts, torch.zeros(4, 3, device=DEVICE))
    with pytest.raises(TypeError, match="experts must have dtype"):
        kernels.router_topk_backward(logits, experts.int(), torch.zeros(4, 2, device=DEVICE))


def test_router_topk_ops():
    """Schema, fake implementations and aot_dispatch of both ops."""
    logits = _separated_logits(13, 40, seed=5, dtype=torch.bfloat16)
    opcheck_fp8(torch.ops.fp8moe.router_topk, (logits, 3))
    _, experts = kernels.router_topk(logits, 3)
    opcheck_fp8(torch.ops.fp8moe.router_topk_backward, (logits, experts, torch.randn(13, 3, device=DEVICE)))


def test_moe_route_is_router_topk_of_the_router():
    torch.manual_seed(0)
    moe = ops.MoE(32, 16, 12, 3, device=DEVICE)
    x = torch.randn(10, 32, device=DEVICE, dtype=torch.bfloat16)
    weights, experts = moe.route(x)
    expected_w, expected_e = kernels.router_topk(moe.router(x).contiguous(), 3)
    assert torch.equal(weights, expected_w) and torch.equal(experts, expected_e)


@pytest.mark.parametrize("tokens, num_experts", [(300, 128), (pytest.param(32768, 256, marks=pytest.mark.cuda))])
def test_router_topk_with_equal_logits_takes_the_top_values(tokens, num_experts):
    """Random bf16 logits repeat values (ties): whichever of equal experts is taken, the chosen probabilities are
    the k largest, so the weights are ``torch.topk``'s; each chosen expert is distinct and its probability is its
    weight times the chosen sum. Up to DeepSeek-V3's router at 32768 tokens on a GPU."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    logits = torch.randn(tokens, num_experts, device=DEVICE, generator=gen).to(torch.bfloat16)
    weights, experts = kernels.router_topk(logits, 8)
    expected, _ = _plain(logits, 8)
    torch.testing.assert_close(weights, expected, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    assert (experts.sort(-1).values.diff(dim=-1) > 0).all()
    probs = torch.softmax(logits.float(), dim=-1).gather(1, experts)
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
