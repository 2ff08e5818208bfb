"""The MoE combine kernels (``kernels_helion.moe_combine``) and ``ops.combine_pairs`` against autograd of the
plain expression: gather the pairs, weight them in float32, sum over the ``k`` choices."""

from __future__ import annotations

import pytest
import torch

import kernels_helion as kernels
import ops
from tests.support import DEVICE

# One bf16 ulp (relative): Triton's interpreter rounds float32 to bf16 toward zero, GPUs to nearest.
BF16_ULP = 2.0**-7


def _routing(tokens: int, top_k: int, num_experts: int, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    experts = torch.randint(0, num_experts, (tokens, top_k), device=DEVICE, generator=gen)
    if tokens:
        experts[0] = min(2, num_experts - 1)  # an expert chosen k times by one token
    probs = torch.rand(tokens, top_k, device=DEVICE, generator=gen).softmax(-1)
    return ops.sort_by_expert(experts, num_experts), probs, gen


def _plain(y, probs, order, tokens, top_k):
    pairs = y.index_select(0, order.inverse).view(tokens, top_k, y.shape[1])
    return (pairs.float() * probs.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


@pytest.mark.parametrize(
    "tokens, top_k, dim, num_experts",
    [(37, 3, 24, 5), (1, 1, 8, 2), (64, 8, 96, 16), (5, 2, 300, 3)],  # unaligned T and D; k = 1; D past one tile
)
def test_combine_pairs_matches_autograd_of_the_plain_expression(tokens, top_k, dim, num_experts):
    """Forward and the gradient of y within one bf16 rounding (bitwise on GPUs for the gradient), the
    probabilities' gradient to float32 summation order; NaN in the gradient reaches both gradients."""
    order, probs, gen = _routing(tokens, top_k, num_experts, seed=tokens + dim)
    y = torch.randn(tokens * top_k, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    grad = torch.randn(tokens, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    grad[0, dim - 1] = float("nan")

    results = []
    for fn in (lambda y, p: _plain(y, p, order, tokens, top_k), lambda y, p: ops.combine_pairs(y, order, p)):
        y_, probs_ = y.clone().requires_grad_(), probs.clone().requires_grad_()
        out = fn(y_, probs_)
        out.backward(grad)
        results.append((out, y_.grad, probs_.grad))
    (out_ref, gy_ref, gp_ref), (out, gy, gp) = results
    for name, expected, actual in (("out", out_ref, out), ("grad y", gy_ref, gy), ("grad probs", gp_ref, gp)):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        assert torch.equal(actual.isnan(), expected.isnan()), name
    torch.testing.assert_close(out, out_ref, rtol=BF16_ULP, atol=1e-6)
    if DEVICE.type == "cuda":
        torch.testing.assert_close(gy, gy_ref, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(gy, gy_ref, rtol=BF16_ULP, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(gp, gp_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert gy.isnan().any() and gp.isnan().any()
    # Deterministic: a second run is bitwise the same.
    y_, probs_ = y.clone().requires_grad_(), probs.clone().requires_grad_()
    again = ops.combine_pairs(y_, order, probs_)
    again.backward(grad)
    for first, second in ((out, again), (gy, y_.grad), (gp, probs_.grad)):
        assert torch.equal(first.view(torch.int16) if first.dtype == torch.bfloat16 else first.view(torch.int32),
                           second.view(torch.int16) if second.dtype == torch.bfloat16 else second.view(torch.int32))


def test_combine_pairs_keeps_only_y_and_takes_no_tokens():
    tokens, top_k, dim, num_experts = 9, 2, 16, 3
    order, probs, gen = _routing(tokens, top_k, num_experts, seed=3)
    y = torch.randn(tokens * top_k, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    # Kept for backward: y itself (and the probs), not a float32 copy of the pairs.
    y_, probs_ = y.clone().requires_grad_(), probs.clone().requires_grad_()
    saved = ops.saved_tensor_bytes(lambda: ops.combine_pairs(y_, order, probs_), exclude=[y_, probs_])
    assert saved == 0, saved
    plain_saved = ops.saved_tensor_bytes(lambda: _plain(y_, probs_, order, tokens, top_k), exclude=[y_, probs_])
    assert plain_saved >= tokens * top_k * dim * 4
    # No tokens (an EP rank may get none).
    empty = ops.sort_by_expert(order.order.new_zeros((0, top_k)), num_experts)
    y0 = y[:0].clone().requires_grad_()
    p0 = probs[:0].clone().requires_grad_()
    out = ops.combine_pairs(y0, empty, p0)
    out.backward(torch.ones_like(out))
    assert out.shape == (0, dim) and y0.grad.shape == (0, dim) and p0.grad.shape == (0, top_k)


def test_combine_kernels_bad_input():
    y = torch.zeros(6, 8, device=DEVICE, dtype=torch.bfloat16)
    inverse = torch.arange(6, device=DEVICE).view(3, 2)
    probs = torch.ones(3, 2, device=DEVICE)
    grad = torch.zeros(3, 8, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="y must have tokens \\* k = 6 rows"):
        kernels.moe_combine(y[:5], inverse, probs)
    with pytest.raises(ValueError, match="same \\(tokens, k\\) shape"):
        kernels.moe_combine(y, inverse, torch.ones(3, 1, device=DEVICE))
    with pytest.raises(TypeError, match="inverse must have dtype"):
        kernels.moe_combine(y, inverse.int(), probs)
    with pytest.raises(TypeError, match="y must have dtype"):
        kernels.moe_combine(y.to(torch.int16), inverse, probs)
    with pytest.raises(TypeError, match="grad must have dtype"):
        kernels.moe_combine_grad_rows(grad.to(torch.int16), inverse.view(-1), probs)
    with pytest.raises(ValueError, match="grad must be \\(T, D\\)"):
        kernels.moe_combine_grad_probs(grad[:2], y, inverse)
    with pytest.raises(ValueError, match="order must be 1-D"):
        kernels.moe_combine_grad_rows(grad, inverse, probs)
