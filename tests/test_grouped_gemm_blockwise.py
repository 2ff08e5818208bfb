from __future__ import annotations

import pytest
import torch

from kernels_helion import (
    grouped_mm_2d3d_blockwise,
    quantize_blockwise_rows,
    quantize_blockwise_weights,
    quantize_blockwise_weights_transposed,
)
from tests.support import DEVICE, group_sizes, offsets_from_sizes, poison_torch_empty, sqnr_db

BLOCK = 128


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``q * scales`` with each scale broadcast over its ``block_rows x block_cols`` block (fp64)."""
    rows, cols = q.shape
    full = scales.double().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return q.double() * full


def ref_grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs) -> torch.Tensor:
    """Dequantize with the block scales and multiply each group by its expert; rows past offs[-1] are 0."""
    a_deq = dequantize_blocks(a, a_scales, 1, BLOCK)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a_deq[start:end] @ dequantize_blocks(b[g], b_scales[g], BLOCK, BLOCK).T
        start = end
    return out


def ref_unquantized(x, w, offs) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[g].double().T
        start = end
    return out


def make_inputs(m, n, k, e, device=DEVICE):
    """Quantized operands from bf16 data with a spread of magnitudes (so the block scales differ)."""
    x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device).add(0.1) * 4).to(torch.bfloat16)
    w = (torch.randn(e, n, k, device=device) * torch.rand(e, n, 1, device=device).add(0.1) * 1e-2).to(torch.bfloat16)
    a, a_scales = quantize_blockwise_rows(x)
    b, b_scales = quantize_blockwise_weights(w)
    return x, w, a, a_scales, b, b_scales


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # atol: bf16 rounding of the largest outputs (2**-9 relative) plus fp32 accumulation error.
    atol = 4e-3 * float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, e", [(150, 160, 200, 4), (97, 72, 256, 3)])
def test_matches_reference(monkeypatch, kind, m, n, k, e):
    sizes = group_sizes(m - 7, e, kind)  # the last 7+ rows are past offs[-1]
    offs = offsets_from_sizes(sizes)
    x, w, a, sa, b, sb = make_inputs(m, n, k, e)
    poison_torch_empty(monkeypatch)  # a row no work item writes shows as NaN
    out = grouped_mm_2d3d_blockwise(a, sa, b, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close_bf16(out, ref_grouped_mm_2d3d_blockwise(a, sa, b, sb, offs))
    assert (out[sum(sizes):] == 0).all(), "rows past offs[-1] must be 0"
    routed = slice(0, sum(sizes))
    assert sqnr_db(out[routed], ref_unquantized(x, w, offs)[routed]) >= 28


def test_dgrad_with_transposed_weight():
    """grad_x = grad_out @ W[g] with W quantized transposed: the same kernel, contraction over N."""
    m, n, k, e = 100, 136, 72, 3
    offs = offsets_from_sizes([40, 0, 55])
    grad_out = torch.randn(m, n, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(e, n, k, device=DEVICE) * 1e-2).to(torch.bfloat16)
    a, sa = quantize_blockwise_rows(grad_out)
    wt, swt = quantize_blockwise_weights_transposed(w)
    out = grouped_mm_2d3d_blockwise(a, sa, wt, swt, offs)
    assert out.shape == (m, k)
    assert_close_bf16(out, ref_grouped_mm_2d3d_blockwise(a, sa, wt, swt, offs))
    expected = ref_unquantized(grad_out, w.transpose(1, 2), offs)
    assert sqnr_db(out[:95], expected[:95]) >= 28
    assert (out[95:] == 0).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_out_dtypes(out_dtype):
    offs = offsets_from_sizes([33, 0, 40])
    _, _, a, sa, b, sb = make_inputs(80, 32, 130, 3)
    out = grouped_mm_2d3d_blockwise(a, sa, b, sb, offs, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_close_bf16(out, ref_grouped_mm_2d3d_blockwise(a, sa, b, sb, offs))


def test_single_row_and_all_groups_empty():
    _, _, a, sa, b, sb = make_inputs(1, 16, 160, 2)
    offs = offsets_from_sizes([0, 1])
    assert_close_bf16(grouped_mm_2d3d_blockwise(a, sa, b, sb, offs), ref_grouped_mm_2d3d_blockwise(a, sa, b, sb, offs))
    assert (grouped_mm_2d3d_blockwise(a, sa, b, sb, offsets_from_sizes([0, 0])) == 0).all()


def test_deterministic():
    offs = offsets_from_sizes(group_sizes(120, 3, "unaligned"))
    _, _, a, sa, b, sb = make_inputs(130, 48, 200, 3)
    assert torch.equal(grouped_mm_2d3d_blockwise(a, sa, b, sb, offs), grouped_mm_2d3d_blockwise(a, sa, b, sb, offs))


def test_bad_offsets_stay_in_bounds():
    _, _, a, sa, b, sb = make_inputs(64, 16, 32, 4)
    offs = torch.tensor([-5, 1000, 10, 70], dtype=torch.int32, device=DEVICE)
    assert grouped_mm_2d3d_blockwise(a, sa, b, sb, offs).shape == (64, 16)


def test_empty_tokens():
    _, _, a, sa, b, sb = make_inputs(0, 16, 32, 2)
    assert grouped_mm_2d3d_blockwise(a, sa, b, sb, offsets_from_sizes([0, 0])).shape == (0, 16)


def _bad(**overrides):
    _, _, a, sa, b, sb = make_inputs(32, 16, 200, 2)
    args = dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes([16, 32]))
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"a": lambda d: d["a"].float()}, TypeError, "a must be one of"),
        ({"b": lambda d: d["b"].to(torch.float8_e5m2)}, TypeError, "b must be one of"),
        ({"b": lambda d: d["b"][:, :, :160].contiguous()}, ValueError, "K = a.shape"),
        ({"a": lambda d: d["a"].t().contiguous().t()}, ValueError, "a must be contiguous"),
        ({"b": lambda d: d["b"][0]}, ValueError, "b must be 3-D"),
        ({"a_scales": lambda d: d["a_scales"][:-1]}, ValueError, r"a_scales must have shape \(32, 2\)"),
        ({"a_scales": lambda d: d["a_scales"].contiguous()}, ValueError, "a_scales must be K-block-major"),
        ({"a_scales": lambda d: d["a_scales"].double()}, TypeError, "a_scales must have dtype"),
        ({"a_scales": lambda d: d["a_scales"][:, 0]}, ValueError, "a_scales must be 2-D"),
        ({"b_scales": lambda d: d["b_scales"][:, :, :1].contiguous()}, ValueError, r"must have shape \(2, 1, 2\)"),
        ({"b_scales": lambda d: d["b_scales"].transpose(1, 2)}, ValueError, "b_scales must"),
        ({"offs": lambda d: d["offs"].long()}, TypeError, "offs must have dtype"),
        ({"offs": lambda d: d["offs"][:1]}, ValueError, "one group end per expert"),
        ({"out_dtype": lambda d: torch.int32}, TypeError, "out_dtype must be one of"),
        ({"b_scales": lambda d: d["b_scales"].tolist()}, TypeError, "b_scales must be a torch.Tensor"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_2d3d_blockwise(**_bad(**overrides))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shape(kind):
    m, n, k, e = 32768, 2048, 7168, 8
    offs = offsets_from_sizes(group_sizes(m - 100, e, kind))
    x, w, a, sa, b, sb = make_inputs(m, n, k, e)
    out = grouped_mm_2d3d_blockwise(a, sa, b, sb, offs)
    assert torch.equal(out, grouped_mm_2d3d_blockwise(a, sa, b, sb, offs)), "not bitwise deterministic"
    start = 0
    for g, end in enumerate(offs.tolist()):
        # First and last 200 rows of each group (covers partial tiles at both ends).
        for rows in () if end == start else (slice(start, min(start + 200, end)), slice(max(end - 200, start), end)):
            ref = dequantize_blocks(a[rows], sa[rows], 1, BLOCK) @ dequantize_blocks(b[g], sb[g], BLOCK, BLOCK).T
            assert_close_bf16(out[rows], ref)
            assert sqnr_db(out[rows], x[rows].double() @ w[g].double().T) >= 28
        start = end
    assert (out[start:] == 0).all()
