"""The down-projection's dgrad with SwiGLU's backward in its epilogue (``grouped_mm_swiglu_backward``) and the
quantizations of its operand (the combine's gradient rows before their weights, read by index).

The kernel against the unfused path it replaces (``grouped_mm_2d3d`` with the weights folded into the row
scales, then ``swiglu_backward``; bitwise where the arithmetic is the same) and against plain PyTorch; its
operand's quantizers against ``quantize_rowwise_rows`` of the gathered rows. Empty groups, one-row groups,
unaligned sizes, rows past ``offs[-1]``, NaN, poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

import ops  # noqa: F401  (defines the fp8moe ops)
from kernels_helion import (
    grouped_mm_2d3d,
    grouped_mm_swiglu_backward,
    quantize_rowwise_rows,
    quantize_rowwise_rows_and_cols_grouped,
    swiglu_backward,
)
from tests.support import DEVICE, offsets_from_sizes, opcheck_fp8, poison_torch_empty

FP8 = torch.float8_e4m3fn
SIZES = {"empty-one-tail": [20, 0, 1, 40], "unaligned-tail": [7, 33, 0], "full": [17, 30, 23]}


def problem(sizes: list[int], m: int = 70, d: int = 96, hidden: int = 48, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(a, a_scales, b, b_scales, offs, gate_up, pair_weights)`` with ``m`` rows, some past ``offs[-1]``."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(sizes)
    a = (torch.randn(m, d, generator=gen) * 8).to(FP8)
    a_scales = torch.rand(m, generator=gen) + 0.5
    b = (torch.randn(experts, hidden, d, generator=gen) * 8).to(FP8)
    b_scales = torch.rand(experts, hidden, generator=gen) + 0.5
    gate_up = torch.randn(m, 2 * hidden, generator=gen).bfloat16()
    weights = torch.rand(m, generator=gen)
    tensors = (a, a_scales, b, b_scales, offsets_from_sizes(sizes, "cpu"), gate_up, weights)
    return tuple(t.to(DEVICE) for t in tensors)


def unit_grads(a, a_scales, b, b_scales, offs) -> torch.Tensor:
    """``u = (a @ b[g]^T) * a_scales * b_scales[g]`` per group in float32 (0 past ``offs[-1]``)."""
    u = torch.zeros(a.shape[0], b.shape[1], device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        u[start:end] = (a[start:end].float() @ b[g].float().T) * a_scales[start:end, None] * b_scales[g]
        start = end
    return u


def reference(a, a_scales, b, b_scales, offs, gate_up, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch in float32: ``u`` per group, ``grad_h = u * w`` rounded, SwiGLU's backward, ``<u, h>``."""
    hidden = b.shape[1]
    u = unit_grads(a, a_scales, b, b_scales, offs)
    start = int(offs[-1])
    gate, up = gate_up[:, :hidden].float(), gate_up[:, hidden:].float()
    sig = torch.sigmoid(gate)
    h = (gate * sig * up).bfloat16().float()
    grad_h = (u * weights[:, None]).bfloat16().float()
    grad_gate = grad_h * up * sig * (1 + gate * (1 - sig))
    grad_up = grad_h * gate * sig
    out = torch.cat([grad_gate, grad_up], dim=1)
    out[start:] = 0
    weight_grads = (u * h).sum(dim=1)
    weight_grads[start:] = 0
    return out, weight_grads


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_unit_weights_are_bitwise_the_unfused_path(monkeypatch, sizes):
    """With weights 1, bitwise ``grouped_mm_2d3d`` then ``swiglu_backward`` (the path it replaces); rows past
    ``offs[-1]`` are 0 (the outputs are poisoned: an element no program writes shows)."""
    a, a_scales, b, b_scales, offs, gate_up, _ = problem(sizes)
    ones = torch.ones(a.shape[0], device=DEVICE)
    grad_h = grouped_mm_2d3d(a, a_scales, b, b_scales, offs, torch.bfloat16)
    expected = swiglu_backward(grad_h, gate_up)
    poison_torch_empty(monkeypatch)
    got, weight_grads = grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up, ones)
    routed = sum(sizes)
    assert torch.equal(got[:routed].view(torch.int16), expected[:routed].view(torch.int16))
    assert not got[routed:].any() and not weight_grads[routed:].any()
    assert not weight_grads.isnan().any()


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_matches_plain_pytorch(sizes):
    """Against plain PyTorch: ``grad_gate_up`` within two bf16 units (``grad_h``'s rounding and the output's;
    Triton's CPU interpreter rounds toward zero where PyTorch rounds to nearest), the weights' gradient to
    float32 summation order."""
    args = problem(sizes)
    got, weight_grads = grouped_mm_swiglu_backward(*args)
    expected, expected_weight_grads = reference(*args)
    assert got.dtype == torch.bfloat16 and weight_grads.dtype == torch.float32
    assert weight_grads.shape == (args[0].shape[0],) and got.shape == args[5].shape
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -5, atol=1e-3 * float(expected.abs().amax()))
    # h's bf16 rounding may differ by a unit per element (the interpreter's rounding): bounded by the row's
    # sum of |u * h| times that unit.
    bound = 2 ** -7 * _abs_products(*args) + 1e-6
    assert ((weight_grads - expected_weight_grads).abs() <= bound).all()
    assert expected_weight_grads[: sum(sizes)].abs().amax() > 0


def _abs_products(a, a_scales, b, b_scales, offs, gate_up, weights) -> torch.Tensor:
    """``sum_j |u[i, j] * h[i, j]|`` per row (the scale of the weights' gradient's rounding)."""
    hidden = b.shape[1]
    u = unit_grads(a, a_scales, b, b_scales, offs)
    gate, up = gate_up[:, :hidden].float(), gate_up[:, hidden:].float()
    return (u * gate * torch.sigmoid(gate) * up).abs().sum(dim=1)


def test_weights_multiply_after_the_product():
    """The weight's gradient is that of the product before the weight (doubling a weight changes ``grad_gate_up``
    and leaves the weights' gradient as it is), and a zero weight gives a zero ``grad_gate_up`` row."""
    args = list(problem([30, 40]))
    base, base_weight_grads = grouped_mm_swiglu_backward(*args)
    args[6] = args[6].clone()
    args[6][3] = 0.0
    args[6][5] *= 2
    got, weight_grads = grouped_mm_swiglu_backward(*args)
    assert torch.equal(weight_grads, base_weight_grads)
    assert not got[3].any() and base[3].any()
    assert not torch.equal(got[5], base[5])
    others = [i for i in range(got.shape[0]) if i not in (3, 5)]
    assert torch.equal(got[others], base[others])


def test_nan_reaches_its_rows_only():
    """NaN in one row's scale (how a quantized row carries it), in one pair's ``gate`` and in one weight:
    those rows' outputs are NaN (the weight's gradient too where the product is), no other row's."""
    a, a_scales, b, b_scales, offs, gate_up, weights = problem([30, 40])
    a_scales = a_scales.clone()
    a_scales[4] = float("nan")
    gate_up = gate_up.clone()
    gate_up[9, 2] = float("nan")
    weights = weights.clone()
    weights[20] = float("nan")
    got, weight_grads = grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up, weights)
    nan_rows = got.isnan().any(dim=1).nonzero().flatten().tolist()
    assert nan_rows == [4, 9, 20]
    assert weight_grads.isnan().nonzero().flatten().tolist() == [4, 9]


def test_bad_input():
    a, a_scales, b, b_scales, offs, gate_up, weights = problem([30, 40])
    with pytest.raises(ValueError, match="gate_up must be \\(M, 2 \\* H\\)"):
        grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up[:, :48].contiguous(), weights)
    with pytest.raises(ValueError, match="pair_weights"):
        grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up, weights[:5])
    with pytest.raises(ValueError, match="b must be \\(E, N, K\\)"):
        grouped_mm_swiglu_backward(a, a_scales, b[:, :, :64].contiguous(), b_scales, offs, gate_up, weights)
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up.to(torch.int16), weights)
    empty, empty_grads = grouped_mm_swiglu_backward(
        a[:0], a_scales[:0], b, b_scales, torch.zeros_like(offs), gate_up[:0], weights[:0]
    )
    assert empty.shape == (0, 96) and empty_grads.shape == (0,)


def test_custom_op():
    opcheck_fp8(torch.ops.fp8moe.grouped_mm_swiglu_backward, problem([30, 40]))


def gathered_problem(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(grad (T, K), pair_tokens (M,), pair_weights (M,), offs, row_multipliers (G, K), token_multipliers (M,))``,
    some pair tokens outside ``[0, T)`` (read as 0), rows past ``offs[-1]``."""
    gen = torch.Generator().manual_seed(seed)
    tokens, m, k, sizes = 23, 70, 80, [20, 0, 1, 40]
    grad = torch.randn(tokens, k, generator=gen).bfloat16()
    pair_tokens = torch.randint(0, tokens, (m,), generator=gen, dtype=torch.int32)
    pair_tokens[[6, 50]] = torch.tensor([-1, tokens], dtype=torch.int32)
    pair_weights = torch.rand(m, generator=gen)
    row_multipliers = torch.rand(len(sizes), k, generator=gen) + 0.5
    token_multipliers = torch.rand(m, generator=gen) + 0.5
    tensors = (grad, pair_tokens, pair_weights, offsets_from_sizes(sizes, "cpu"), row_multipliers, token_multipliers)
    return tuple(t.to(DEVICE) for t in tensors)


def gathered_rows(grad: torch.Tensor, pair_tokens: torch.Tensor) -> torch.Tensor:
    """``grad[pair_tokens]`` with indices outside ``grad`` read as zero rows."""
    valid = (pair_tokens >= 0) & (pair_tokens < grad.shape[0])
    rows = grad[pair_tokens.clamp(0, grad.shape[0] - 1).long()]
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


@pytest.mark.parametrize("folded", [False, True])
def test_quantize_rowwise_rows_reads_rows_by_index(monkeypatch, folded):
    """``quantize_rowwise_rows(x, rows=)`` is bitwise that of the gathered copy ``x[rows]``."""
    grad, pair_tokens, _, offs, row_multipliers, _ = gathered_problem()
    fold = {"offs": offs, "row_multipliers": row_multipliers} if folded else {}
    expected = quantize_rowwise_rows(gathered_rows(grad, pair_tokens), **fold)
    poison_torch_empty(monkeypatch)
    got = quantize_rowwise_rows(grad, **fold, rows=pair_tokens)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(got[1], expected[1])
    with pytest.raises(TypeError, match="rows must have dtype"):
        quantize_rowwise_rows(grad, rows=pair_tokens.float())


def test_two_pass_quantizer_rows_before_their_weights(monkeypatch):
    """``weight_rows=False``: the rowwise form is that of ``grad[pair_tokens]`` (times the row multipliers),
    bitwise; the columnwise form is the weighted rows', bitwise the default's."""
    grad, pair_tokens, pair_weights, offs, row_multipliers, token_multipliers = gathered_problem()
    kwargs = {"row_multipliers": row_multipliers, "token_multipliers": token_multipliers, "pair_tokens": pair_tokens,
              "pair_weights": pair_weights}
    weighted = quantize_rowwise_rows_and_cols_grouped(grad, offs, **kwargs)
    poison_torch_empty(monkeypatch)
    got = quantize_rowwise_rows_and_cols_grouped(grad, offs, **kwargs, weight_rows=False)
    rows = quantize_rowwise_rows(gathered_rows(grad, pair_tokens), offs=offs, row_multipliers=row_multipliers)
    assert torch.equal(got[0].view(torch.uint8), rows[0].view(torch.uint8))
    assert torch.equal(got[1], rows[1])
    assert torch.equal(got[2].view(torch.uint8), weighted[2].view(torch.uint8))
    assert torch.equal(got[3], weighted[3])
    assert not torch.equal(got[1], weighted[1])
