from __future__ import annotations

import pytest
import torch

from kernels_helion import (
    FP8_DTYPES,
    quantize_rowwise_expert_weights,
    quantize_rowwise_expert_weights_and_transpose,
    quantize_rowwise_expert_weights_both_layouts,
    quantize_rowwise_expert_weights_transposed,
)
from tests.reference import ref_quantize_expert_weights, ref_quantize_expert_weights_transposed
from tests.support import DEVICE, assert_fp8_equal, poison_torch_empty


def _weights(shape: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Per-expert and per-row magnitudes differ, so every scale is distinct.
    e, n, _ = shape
    mag = torch.rand(e, n, 1, device=DEVICE) * torch.rand(e, 1, 1, device=DEVICE) * 20
    return (torch.randn(shape, device=DEVICE) * mag).to(dtype)


def _check_all(w: torch.Tensor, float8_dtype: torch.dtype, pow2: bool) -> None:
    rq, rs = ref_quantize_expert_weights(w, float8_dtype, pow2)
    rqt, rst = ref_quantize_expert_weights_transposed(w, float8_dtype, pow2)
    q, s = quantize_rowwise_expert_weights(w, float8_dtype, pow2)
    qt, st = quantize_rowwise_expert_weights_transposed(w, float8_dtype, pow2)
    dq, ds, dqt, dst = quantize_rowwise_expert_weights_both_layouts(w, float8_dtype, pow2)
    for actual, expected in ((s, rs), (st, rst), (ds, rs), (dst, rst)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    for actual, expected in ((q, rq), (qt, rqt), (dq, rq), (dqt, rqt)):
        assert_fp8_equal(actual, expected)
    assert qt.is_contiguous() and qt.shape == (w.size(0), w.size(2), w.size(1))
    _check_and_transpose(w, float8_dtype, pow2)


def _check_and_transpose(w: torch.Tensor, float8_dtype: torch.dtype, pow2: bool) -> None:
    """``quantize_rowwise_expert_weights_and_transpose``: the forward reference, and its bytes transposed."""
    rq, rs = ref_quantize_expert_weights(w, float8_dtype, pow2)
    q, s, qt = quantize_rowwise_expert_weights_and_transpose(w, float8_dtype, pow2)
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    assert_fp8_equal(q, rq)
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
    assert qt.is_contiguous() and qt.dtype == float8_dtype


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_reference(float8_dtype, pow2):
    _check_all(_weights((3, 37, 70)), float8_dtype, pow2)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 130, 33), (2, 5, 200)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_shapes_and_input_dtypes(shape, in_dtype):
    _check_all(_weights(shape, in_dtype), torch.float8_e4m3fn, False)


@pytest.mark.parametrize("shape", [(3, 37, 70), (2, 70, 300), (1, 1, 1)])
def test_rows_and_transpose_write_every_element(monkeypatch, shape):
    # Outputs allocated as NaN / 0xFF poison: each byte and scale of both layouts is written,
    # for row blocks and column tiles that do not divide N and K.
    poison_torch_empty(monkeypatch)
    _check_and_transpose(_weights(shape), torch.float8_e4m3fn, False)


def test_zero_row_and_column_have_finite_scales_and_zero_output():
    w = _weights((2, 24, 40))
    w[0, 3, :] = 0
    w[1, :, 7] = 0
    dq, ds, dqt, dst = quantize_rowwise_expert_weights_both_layouts(w)
    assert torch.isfinite(ds).all() and torch.isfinite(dst).all()
    assert (dq[0, 3].float() == 0).all() and (dqt[1, 7].float() == 0).all()
    _check_all(w, torch.float8_e4m3fn, False)


def test_nan_and_inf_propagate():
    w = _weights((2, 24, 40))
    w[0, 5, 9] = float("nan")
    w[1, 2, 3] = float("inf")
    dq, ds, dqt, dst = quantize_rowwise_expert_weights_both_layouts(w)
    assert torch.isinf(ds[0, 5]) and torch.isinf(ds[1, 2])
    assert torch.isinf(dst[0, 9]) and torch.isinf(dst[1, 3])
    assert torch.isnan(dq[0, 5, 9].float()) and torch.isnan(dqt[1, 3, 2].float())
    assert torch.isfinite(ds[0, :5]).all() and torch.isfinite(dst[0, :9]).all()
    _check_all(w, torch.float8_e4m3fnuz, True)


@pytest.mark.parametrize(
    "w, kwargs, error, match",
    [
        (torch.randn(2, 4, 8, dtype=torch.float64), {}, TypeError, "w must have dtype"),
        (torch.randn(4, 8), {}, ValueError, "w must be 3-D"),
        (torch.randn(4, 2, 8).transpose(0, 1), {}, ValueError, "w must be contiguous"),
        (torch.randn(2, 0, 8), {}, ValueError, "E, N, K >= 1"),
        (torch.randn(2, 4, 8), {"float8_dtype": torch.float8_e5m2}, TypeError, "float8_dtype must be one of"),
        ("w", {}, TypeError, "w must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize(
    "fn",
    [
        quantize_rowwise_expert_weights,
        quantize_rowwise_expert_weights_transposed,
        quantize_rowwise_expert_weights_both_layouts,
        quantize_rowwise_expert_weights_and_transpose,
    ],
)
def test_bad_input(fn, w, kwargs, error, match):
    with pytest.raises(error, match=match):
        fn(w.to(DEVICE) if isinstance(w, torch.Tensor) else w, **kwargs)


@pytest.mark.parametrize("fn", [quantize_rowwise_expert_weights, quantize_rowwise_expert_weights_transposed,
                                quantize_rowwise_expert_weights_both_layouts])
def test_transposed_view_refused_where_not_read_as_stored(fn):
    with pytest.raises(ValueError, match="w must be contiguous"):
        fn(torch.randn(2, 8, 4, device=DEVICE).transpose(1, 2))


def _check_stored_transposed(w: torch.Tensor, float8_dtype: torch.dtype, pow2: bool) -> None:
    """``quantize_rowwise_expert_weights_and_transpose`` of ``w`` stored transposed (read as stored) is
    bitwise its result for ``w`` contiguous, all three outputs contiguous."""
    view = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not view.is_contiguous()
    torch.testing.assert_close(view, w, rtol=0, atol=0, equal_nan=True)
    expected = quantize_rowwise_expert_weights_and_transpose(w, float8_dtype, pow2)
    q, s, qt = quantize_rowwise_expert_weights_and_transpose(view, float8_dtype, pow2)
    torch.testing.assert_close(s, expected[1], rtol=0, atol=0, equal_nan=True)
    assert_fp8_equal(q, expected[0])
    assert_fp8_equal(qt, expected[2])
    assert q.is_contiguous() and qt.is_contiguous() and s.is_contiguous()


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(3, 37, 70), (1, 2, 3), (2, 130, 33)])
def test_stored_transposed_matches_contiguous(float8_dtype, pow2, shape):
    _check_stored_transposed(_weights(shape), float8_dtype, pow2)


def test_stored_transposed_writes_every_element_and_propagates_nan(monkeypatch):
    poison_torch_empty(monkeypatch)
    w = _weights((2, 70, 40), torch.float32)
    w[0, 5, 9] = float("nan")
    w[1, 2, 3] = float("inf")
    w[1, 7, :] = 0
    _check_stored_transposed(w, torch.float8_e4m3fn, False)
    _, s, qt = quantize_rowwise_expert_weights_and_transpose(w.transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.isinf(s[0, 5]) and torch.isinf(s[1, 2]) and s[1, 7] > 0
    assert torch.isnan(qt[0, 9, 5].float()) and (qt[1, :, 7].float() == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 5760, 2880), (32, 2880, 2880)])
def test_gpt_oss_weights_stored_transposed_bitwise(shape):
    # gpt-oss's gate_up_proj and down_proj, stored (E, in, out).
    _check_stored_transposed(_weights(shape), torch.float8_e4m3fn, False)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16, 8192, 5120), (8, 2048, 7168)])
def test_benchmark_shapes_bitwise(shape):
    _check_all(_weights(shape), torch.float8_e4m3fn, False)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(128, 768, 2048), (128, 2048, 768), (256, 2048, 7168), (256, 7168, 2048)])
def test_fine_grained_weights_and_transpose_bitwise(shape):
    # Qwen3-30B-A3B's and DeepSeek-V3's expert weights (w1/w3, w2): the folded dgrad's two layouts.
    _check_and_transpose(_weights(shape), torch.float8_e4m3fn, False)
