"""Blockwise 2D x 3D grouped GEMM (``grouped_mm_2d3d_blockwise``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_2d3d_blockwise, quantize_blockwise_rows, quantize_blockwise_weights_transposed
from tests.gemm_formats import BLOCK, assert_close_out, dequantize_blocks, make_blockwise_2d3d, ref_grouped_mm_2d3d_blockwise
from tests.support import DEVICE, group_sizes, offsets_from_sizes, poison_torch_empty, sqnr_db

make_inputs = make_blockwise_2d3d


def ref_unquantized(x, w, offs) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[g].double().T
        start = end
    return out


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, e", [(150, 160, 200, 4), (97, 72, 256, 3)])
def test_matches_reference(monkeypatch, kind, m, n, k, e):
    sizes = group_sizes(m - 7, e, kind)  # the last 7+ rows are past offs[-1]
    offs = offsets_from_sizes(sizes)
    x, w, a, sa, b, sb = make_inputs(m, n, k, e)
    poison_torch_empty(monkeypatch)  # a row no work item writes shows as NaN
    out = grouped_mm_2d3d_blockwise(a, sa, b, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close_out(out, ref_grouped_mm_2d3d_blockwise(a, sa, b, sb, offs))
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
    assert_close_out(out, ref_grouped_mm_2d3d_blockwise(a, sa, wt, swt, offs))
    expected = ref_unquantized(grad_out, w.transpose(1, 2), offs)
    assert sqnr_db(out[:95], expected[:95]) >= 28
    assert (out[95:] == 0).all()


def _bad(**overrides):
    _, _, a, sa, b, sb = make_inputs(32, 16, 200, 2)
    args = dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes([16, 32]))
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"b": lambda d: d["b"][:, :, :160].contiguous()}, ValueError, "K = a.shape"),
        ({"a_scales": lambda d: d["a_scales"][:-1]}, ValueError, r"a_scales must have shape \(32, 2\)"),
        ({"a_scales": lambda d: d["a_scales"].contiguous()}, ValueError, "a_scales must be K-block-major"),
        ({"a_scales": lambda d: d["a_scales"].double()}, TypeError, "a_scales must have dtype"),
        ({"a_scales": lambda d: d["a_scales"][:, 0]}, ValueError, "a_scales must be 2-D"),
        ({"b_scales": lambda d: d["b_scales"][:, :, :1].contiguous()}, ValueError, r"must have shape \(2, 1, 2\)"),
        ({"b_scales": lambda d: d["b_scales"].transpose(1, 2)}, ValueError, "b_scales must"),
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
            assert_close_out(out[rows], ref)
            assert sqnr_db(out[rows], x[rows].double() @ w[g].double().T) >= 28
        start = end
    assert (out[start:] == 0).all()
