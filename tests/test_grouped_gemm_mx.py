"""MXFP8 2D x 3D grouped GEMM (``grouped_mm_2d3d_mx``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_2d3d_mx
from tests.gemm_formats import FP8, assert_close_out, make_mx_2d3d, ref_dequantize_mx, ref_grouped_mm_mx
from tests.support import DEVICE, group_sizes, offsets_from_sizes, poison_torch_empty, sqnr_db

make_inputs = make_mx_2d3d


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, e", [(150, 48, 64, 4), (97, 40, 96, 3)])
def test_matches_reference(monkeypatch, kind, m, n, k, e):
    sizes = group_sizes(m - 7, e, kind)  # the last 7+ rows are past offs[-1]
    offs = offsets_from_sizes(sizes)
    x, w, a, sa, b, sb = make_inputs(m, n, k, e)
    poison_torch_empty(monkeypatch)  # a row no work item writes shows as NaN
    out = grouped_mm_2d3d_mx(a, sa, b, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = ref_grouped_mm_mx(a, sa, b, sb, offs)
    assert_close_out(out, ref)
    assert (out[sum(sizes):] == 0).all(), "rows past offs[-1] must be 0"
    # Against the exact product of the unquantized inputs: MXFP8 + bf16 output error only.
    start, exact = 0, torch.zeros(m, n, dtype=torch.float64, device=DEVICE)
    for g, end in enumerate(offs.tolist()):
        exact[start:end] = x[start:end].double() @ w[g].double().T
        start = end
    assert sqnr_db(out, exact) >= 27


def test_extreme_scales_are_exact():
    # 2**-127 (e8m0 0, an fp32 subnormal) times 2**127 (254) is exactly 1, as is 2**-60 * 2**60.
    offs = offsets_from_sizes([20, 12])
    _, _, a, sa, b, sb = make_inputs(40, 16, 64, 2)
    sa = torch.zeros_like(sa)
    sa[:, 1] = 67
    sb = torch.full_like(sb, 254)
    sb[:, :, 1] = 187
    out = grouped_mm_2d3d_mx(a, sa, b, sb, offs, out_dtype=torch.float32)
    assert out.isfinite().all()
    assert_close_out(out, ref_grouped_mm_mx(a, sa, b, sb, offs))


def test_e8m0_dtype_scales():
    offs = offsets_from_sizes([10, 20])
    _, _, a, sa, b, sb = make_inputs(32, 16, 64, 2)
    out = grouped_mm_2d3d_mx(a, sa.view(torch.float8_e8m0fnu), b, sb.view(torch.float8_e8m0fnu), offs)
    assert torch.equal(out, grouped_mm_2d3d_mx(a, sa, b, sb, offs))


def test_nan_scale_propagates():
    offs = offsets_from_sizes([20, 30])
    _, _, a, sa, b, sb = make_inputs(64, 16, 64, 2)
    sa[5, 1] = 255  # row 5 (group 0): the whole row
    sb[1, 3, 0] = 255  # expert 1, column 3: rows of group 1
    out = grouped_mm_2d3d_mx(a, sa, b, sb, offs, out_dtype=torch.float32)
    expected_nan = torch.zeros(64, 16, dtype=torch.bool)
    expected_nan[5, :] = True
    expected_nan[20:50, 3] = True
    assert torch.equal(out.isnan().cpu(), expected_nan)
    assert (out[50:] == 0).all()
    ref = ref_grouped_mm_mx(a, sa, b, sb, offs)
    assert_close_out(out.nan_to_num(), ref.nan_to_num())


def _bad(**overrides):
    _, _, a, sa, b, sb = make_inputs(32, 16, 64, 2)
    args = dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes([16, 32]))
    args.update({k: v(args) for k, v in overrides.items()})
    return args


def _fp8_zeros(*shape):
    return lambda d: torch.zeros(*shape, device=DEVICE).to(FP8)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"a": lambda d: d["a"][:, :32].contiguous()}, ValueError, "K = a.shape"),
        ({"a": _fp8_zeros(32, 48), "b": _fp8_zeros(2, 16, 48)}, ValueError, "multiple of the MX block size 32"),
        ({"a_scales": lambda d: d["a_scales"].float()}, TypeError, "a_scales must have dtype"),
        ({"a_scales": lambda d: d["a_scales"][:, :1].contiguous()}, ValueError, r"a_scales must have shape \(32, 2\)"),
        ({"a_scales": lambda d: d["a_scales"][:-1]}, ValueError, r"a_scales must have shape \(32, 2\)"),
        ({"b_scales": lambda d: d["b_scales"].to(torch.int32)}, TypeError, "b_scales must have dtype"),
        ({"b_scales": lambda d: d["b_scales"][:1]}, ValueError, r"b_scales must have shape \(2, 16, 2\)"),
        ({"b_scales": lambda d: d["b_scales"][0]}, ValueError, "b_scales must be 3-D"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_2d3d_mx(**_bad(**overrides))


def test_fnuz_is_not_an_mx_element_type():
    fnuz = torch.float8_e4m3fnuz
    args = _bad(a=lambda d: d["a"].float().to(fnuz), b=lambda d: d["b"].float().to(fnuz))
    with pytest.raises(TypeError, match="e4m3fn|ROCm"):
        grouped_mm_2d3d_mx(**args)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shape(kind):
    m, n, k, e = 32768, 2048, 7168, 8
    offs = offsets_from_sizes(group_sizes(m - 100, e, kind))
    x, w, a, sa, b, sb = make_inputs(m, n, k, e)
    out = grouped_mm_2d3d_mx(a, sa, b, sb, offs)
    assert torch.equal(out, grouped_mm_2d3d_mx(a, sa, b, sb, offs)), "not bitwise deterministic"
    start = 0
    for g, end in enumerate(offs.tolist()):
        # First and last 200 rows of each group (covers partial tiles at both ends).
        for rows in () if end == start else (slice(start, min(start + 200, end)), slice(max(end - 200, start), end)):
            ref = ref_dequantize_mx(a[rows], sa[rows]) @ ref_dequantize_mx(b[g], sb[g]).T
            assert_close_out(out[rows], ref)
            assert sqnr_db(out[rows], x[rows].double() @ w[g].double().T) >= 27
        start = end
    assert (out[start:] == 0).all()
