from __future__ import annotations

import pytest
import torch

from kernels_helion import (
    FP8_DTYPES,
    quantize_rowwise_cols_grouped,
    quantize_rowwise_wgrad_operands,
    quantize_rowwise_cols_grouped_from_transposed,
)
import kernels_helion.quantize_rowwise_grouped as rowwise_grouped_module
from kernels_helion.quantize_rowwise_two_pass import two_pass_cast_config
from tests.reference import ref_pad_token_columns, ref_quantize_rowwise_cols_grouped
from tests.support import DEVICE, assert_fp8_equal, group_sizes, offsets_from_sizes


def _tokens(m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Per-token and per-column magnitudes differ, so every scale is distinct.
    mag = torch.rand(m, 1, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 30
    return (torch.randn(m, k, device=DEVICE) * mag).to(dtype)


# Alignment 1 (plain layout) runs the column-strip kernel; the recipes' 128 runs
# it too for small groups, else the two-pass kernels of quantize_rowwise_rows_and_cols
# with the rowwise output off: each test of the layouts runs all three.
LAYOUTS = ["plain", "padded, strip", "padded, two-pass"]


@pytest.fixture
def alignment(request, monkeypatch) -> int:
    """The ``group_alignment`` of the parametrized layout, with the kernel choice forced."""
    layout = request.param
    if layout == "padded, two-pass":
        monkeypatch.setattr(rowwise_grouped_module, "TWO_PASS_MIN_TOKENS_PER_GROUP", 0)
    elif layout == "padded, strip":
        monkeypatch.setattr(rowwise_grouped_module, "TWO_PASS_MIN_TOKENS_PER_GROUP", 1 << 40)
    return 1 if layout == "plain" else 128


def _check_all(x, grad_out, offs, float8_dtype=torch.float8_e4m3fn, pow2=False, alignment=1) -> None:
    """cols_grouped, cols_grouped_from_transposed (on x.t()) and wgrad_operands all match the reference bitwise."""
    rq, rs = ref_quantize_rowwise_cols_grouped(x, offs, float8_dtype, pow2)
    rgq, rgs = ref_quantize_rowwise_cols_grouped(grad_out, offs, float8_dtype, pow2)
    if alignment > 1:
        rq, rgq = ref_pad_token_columns(rq, offs, alignment), ref_pad_token_columns(rgq, offs, alignment)
    quant = (float8_dtype, pow2, alignment)
    results = [
        (quantize_rowwise_cols_grouped(x, offs, *quant), (rq, rs)),
        (quantize_rowwise_cols_grouped_from_transposed(x.t().contiguous(), offs, *quant), (rq, rs)),
    ]
    xq, xs, gq, gs = quantize_rowwise_wgrad_operands(x, grad_out, offs, *quant)
    results += [((xq, xs), (rq, rs)), ((gq, gs), (rgq, rgs))]
    for (q, s), (eq, es) in results:
        torch.testing.assert_close(s, es, rtol=0, atol=0, equal_nan=True)
        assert_fp8_equal(q, eq)
        assert q.is_contiguous()


@pytest.mark.parametrize("alignment", LAYOUTS, indirect=True)
@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_reference(float8_dtype, pow2, alignment):
    # Empty group, one-token group, unaligned sizes, tokens past offs[-1].
    sizes = [0, 1, 37, 0, 150]
    x, grad_out = _tokens(200, 45), _tokens(200, 19)
    _check_all(x, grad_out, offsets_from_sizes(sizes), float8_dtype, pow2, alignment)


@pytest.mark.parametrize("alignment", LAYOUTS, indirect=True)
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_group_size_kinds(kind, alignment):
    m = 300
    x, grad_out = _tokens(m, 24), _tokens(m, 40, torch.float32)
    _check_all(x, grad_out, offsets_from_sizes(group_sizes(m - 5, 6, kind)), alignment=alignment)


def test_padded_layouts_take_the_two_pass_kernels():
    # So that the tests at alignment 128 cover them (16 is below the CPU's cast tile: strip kernel).
    x, offs = _tokens(300, 24), offsets_from_sizes([100, 200])
    assert two_pass_cast_config(x, offs, 128) is not None
    assert DEVICE.type == "cuda" or two_pass_cast_config(x, offs, 16) is None


def test_single_group_and_single_token():
    _check_all(_tokens(1, 3), _tokens(1, 2), offsets_from_sizes([1]))
    _check_all(_tokens(130, 33, torch.float16), _tokens(130, 17), offsets_from_sizes([130]))


@pytest.mark.parametrize("alignment", LAYOUTS, indirect=True)
def test_out_of_range_offsets_are_clamped(alignment):
    # Negative and past-the-end ends: bounds are clamped into [0, M].
    offs = torch.tensor([-5, 50, 90, 400], dtype=torch.int32, device=DEVICE)
    _check_all(_tokens(120, 16), _tokens(120, 8), offs, alignment=alignment)


@pytest.mark.parametrize("alignment", [16, 128])
def test_padded_token_layout(alignment):
    # Each group from an aligned column, zeros between groups and after the last
    # (empty group, one-token group, a group of exactly `alignment`, tokens past offs[-1]).
    sizes = [0, 1, 37, alignment, 0, 90]
    m = sum(sizes) + 11
    x, grad_out = _tokens(m, 24), _tokens(m, 40, torch.float32)
    offs = offsets_from_sizes(sizes)
    rq, rs = ref_quantize_rowwise_cols_grouped(x, offs, torch.float8_e4m3fn, False)
    rgq, rgs = ref_quantize_rowwise_cols_grouped(grad_out, offs, torch.float8_e4m3fn, False)
    xq, xs, gq, gs = quantize_rowwise_wgrad_operands(x, grad_out, offs, group_alignment=alignment)
    results = [
        (quantize_rowwise_cols_grouped(x, offs, group_alignment=alignment), (rq, rs)),
        (quantize_rowwise_cols_grouped_from_transposed(x.t().contiguous(), offs, group_alignment=alignment), (rq, rs)),
        ((xq, xs), (rq, rs)),
        ((gq, gs), (rgq, rgs)),
    ]
    for (q, s), (eq, es) in results:
        assert q.shape == (eq.shape[0], (-(-m // alignment) + len(sizes)) * alignment) and q.is_contiguous()
        torch.testing.assert_close(s, es, rtol=0, atol=0)
        assert_fp8_equal(q, ref_pad_token_columns(eq, offs, alignment))


@pytest.mark.parametrize("alignment", LAYOUTS[1:], indirect=True)
def test_padding_stays_zero_with_nan_input(alignment):
    x = _tokens(40, 16)
    x[3, 5] = float("nan")
    q, s = quantize_rowwise_cols_grouped(x, offsets_from_sizes([10, 30]), group_alignment=alignment)
    assert torch.isnan(s[0, 5]) or torch.isinf(s[0, 5])
    second = alignment  # the second group's first column
    assert (q[:, 10:second].float() == 0).all() and (q[:, second + 30 :].float() == 0).all()


@pytest.mark.parametrize("alignment", LAYOUTS[1:], indirect=True)
def test_bad_offsets_in_padded_layout_stay_in_bounds(alignment):
    # Decreasing and past-the-end ends would add up to more padded columns than the
    # bound: positions are clamped into it (wrong groups, never out of bounds).
    x = _tokens(100, 24)
    offs = torch.tensor([100, 0, 100, 0, 100], dtype=torch.int32, device=DEVICE)
    q, s = quantize_rowwise_cols_grouped(x, offs, group_alignment=alignment)
    assert q.shape == (24, (-(-100 // alignment) + 5) * alignment) and s.shape == (5, 24)


def test_bad_group_alignment():
    with pytest.raises(ValueError, match="group_alignment must be an int >= 1"):
        quantize_rowwise_cols_grouped(_tokens(16, 8), offsets_from_sizes([16]), group_alignment=0)


def test_tokens_past_last_group_are_zero_and_empty_group_scale_is_finite():
    x = _tokens(64, 32)
    xq, xs = quantize_rowwise_cols_grouped(x, offsets_from_sizes([20, 0, 30]))
    assert (xq[:, 50:].float() == 0).all()
    assert torch.isfinite(xs).all() and (xs[1] > 0).all()


def test_zero_group_has_finite_scale_and_zero_output():
    x = _tokens(64, 32)
    x[10:30] = 0
    xq, xs = quantize_rowwise_cols_grouped(x, offsets_from_sizes([10, 20, 34]))
    assert torch.isfinite(xs).all() and (xq[:, 10:30].float() == 0).all()


def test_nan_and_inf_propagate():
    x, grad_out = _tokens(64, 32), _tokens(64, 16)
    x[3, 5] = float("nan")
    grad_out[40, 2] = float("inf")
    offs = offsets_from_sizes([20, 44])
    xq, xs, gq, gs = quantize_rowwise_wgrad_operands(x, grad_out, offs)
    assert torch.isinf(xs[0, 5]) and torch.isinf(gs[1, 2])
    assert torch.isnan(xq[5, 3].float()) and torch.isnan(gq[2, 40].float())
    assert torch.isfinite(xs[1]).all() and torch.isfinite(gs[0]).all()
    _check_all(x, grad_out, offs, torch.float8_e4m3fnuz, True)


def test_no_tokens():
    xq, xs = quantize_rowwise_cols_grouped(_tokens(0, 8), offsets_from_sizes([0, 0]))
    assert xq.shape == (8, 0) and xs.shape == (2, 8) and torch.isfinite(xs).all()


_OFFS = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "x, offs, error, match",
    [
        (torch.randn(8, 4, dtype=torch.float64), _OFFS, TypeError, "x must have dtype"),
        (torch.randn(2, 8, 4), _OFFS, ValueError, "x must be 2-D"),
        (torch.randn(4, 8).t(), _OFFS, ValueError, "x must be contiguous"),
        (torch.randn(8, 0), _OFFS, ValueError, "at least one feature column"),
        (torch.randn(8, 4), torch.tensor([4, 8]), TypeError, "offs must have dtype"),
        (torch.randn(8, 4), _OFFS[None], ValueError, "offs must be 1-D"),
        (torch.randn(8, 4), _OFFS[:0], ValueError, "at least one group end"),
        (torch.randn(8, 4), [4, 8], TypeError, "offs must be a torch.Tensor"),
    ],
)
def test_bad_input(x, offs, error, match):
    x = x.to(DEVICE)
    offs = offs.to(DEVICE) if isinstance(offs, torch.Tensor) else offs
    good = torch.randn(8, 3, device=DEVICE)
    with pytest.raises(error, match=match):
        quantize_rowwise_cols_grouped(x, offs)
    with pytest.raises(error, match=match):
        quantize_rowwise_wgrad_operands(x, good, offs)
    with pytest.raises(error, match=match.replace("x ", "grad_out ")):
        quantize_rowwise_wgrad_operands(good, x, offs)


@pytest.mark.parametrize("alignment", ["plain", "padded, strip"], indirect=True)
def test_token_multipliers(alignment):
    """``x * token_multipliers[:, None]`` quantized; on the padded layout they take the two-pass kernels
    even for small groups, elsewhere PyTorch multiplies first."""
    x = _tokens(150, 40)
    offs = offsets_from_sizes([0, 1, 37, 100])  # 12 tokens past offs[-1], small groups
    per_token = torch.rand(150, device=DEVICE) * 8 + 1e-3
    q, s = quantize_rowwise_cols_grouped(x, offs, torch.float8_e4m3fnuz, True, alignment, per_token)
    eq, es = ref_quantize_rowwise_cols_grouped(x.float() * per_token[:, None], offs, torch.float8_e4m3fnuz, True)
    torch.testing.assert_close(s, es, rtol=0, atol=0)
    assert_fp8_equal(q, ref_pad_token_columns(eq, offs, alignment) if alignment > 1 else eq)
    with pytest.raises(ValueError, match=r"token_multipliers must have shape \(150,\)"):
        quantize_rowwise_cols_grouped(x, offs, group_alignment=alignment, token_multipliers=per_token[:-1])


def test_bad_input_specific():
    x, offs = _tokens(8, 4), offsets_from_sizes([4, 4])
    with pytest.raises(ValueError, match="grad_out must have as many rows"):
        quantize_rowwise_wgrad_operands(x, _tokens(9, 4), offs)
    with pytest.raises(TypeError, match="float8_dtype must be one of"):
        quantize_rowwise_cols_grouped_from_transposed(x.t().contiguous(), offs, torch.float8_e5m2)
    with pytest.raises(ValueError, match="xt must be contiguous"):
        quantize_rowwise_cols_grouped_from_transposed(x.t(), offs)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="offs must be on"):
            quantize_rowwise_cols_grouped(x, offs.cpu())


@pytest.mark.cuda
def test_offsets_on_wrong_device():
    x = _tokens(8, 4)
    with pytest.raises(ValueError, match="offs must be on"):
        quantize_rowwise_cols_grouped(x, torch.tensor([8], dtype=torch.int32))
    with pytest.raises(ValueError, match="grad_out must be on"):
        quantize_rowwise_wgrad_operands(x, x.cpu(), offsets_from_sizes([8]))


@pytest.mark.cuda
@pytest.mark.parametrize("alignment", LAYOUTS, indirect=True)
@pytest.mark.parametrize("groups, kind", [(1, "uniform"), (16, "skewed"), (64, "uniform")])
def test_benchmark_shapes_bitwise(groups, kind, alignment):
    m = 32768
    x, grad_out = _tokens(m, 5120), _tokens(m, 2048)
    _check_all(x, grad_out, offsets_from_sizes(group_sizes(m, groups, kind)), alignment=alignment)
