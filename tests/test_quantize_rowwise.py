from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import FP8_DTYPES, quantize_rowwise_rows
from kernels_helion.quantize_rowwise import DEFAULT_CONFIG
from tests.reference import ref_quantize_rowwise
from tests.support import DEVICE, assert_fp8_equal


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (64, 512), (5, 1000)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(float8_dtype, pow2, shape, in_dtype):
    x = (torch.randn(shape, device=DEVICE) * torch.rand(shape[0], 1, device=DEVICE) * 50).to(in_dtype)
    q, s = quantize_rowwise_rows(x, float8_dtype, pow2)
    rq, rs = ref_quantize_rowwise(x, float8_dtype, pow2)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert_fp8_equal(q, rq)


@pytest.mark.parametrize("rows_per_program", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 17, 80, 1536])
def test_row_pieces_cover_every_width(rows_per_program, k):
    # A row is a power-of-two head and a masked tail (row_pieces): widths just past a
    # power of two, equal to one, and below the tail's 16 lanes, with the GPU's row tiles.
    config = helion.Config(**{**DEFAULT_CONFIG.config, "block_sizes": [rows_per_program]})
    x = torch.randn(6, k, device=DEVICE) * 10
    with forced_config("quantize_rowwise_rows", config):
        q, s = quantize_rowwise_rows(x)
    rq, rs = ref_quantize_rowwise(x, torch.float8_e4m3fn, False)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert_fp8_equal(q, rq)


def test_zero_row_has_finite_scale_and_zero_output():
    x = torch.randn(4, 96, device=DEVICE, dtype=torch.bfloat16)
    x[2] = 0
    q, s = quantize_rowwise_rows(x)
    assert torch.isfinite(s).all() and s[2] > 0
    assert (q[2].float() == 0).all()


def test_nan_and_inf_propagate():
    x = torch.randn(4, 96, device=DEVICE, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[3, 7] = float("inf")
    q, s = quantize_rowwise_rows(x)
    assert torch.isinf(s[1]) and torch.isinf(s[3])
    assert torch.isnan(q[1, 5].float()) and torch.isnan(q[3, 7].float())
    assert torch.isfinite(s[[0, 2]]).all()


def test_empty_rows():
    q, s = quantize_rowwise_rows(torch.randn(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0,)


@pytest.mark.parametrize(
    "x, kwargs, error, match",
    [
        (torch.randn(4, 8, dtype=torch.float64), {}, TypeError, "x must have dtype"),
        (torch.randn(2, 4, 8), {}, ValueError, "x must be 2-D"),
        (torch.randn(8, 4).t(), {}, ValueError, "x must be contiguous"),
        (torch.randn(4, 0), {}, ValueError, "at least one column"),
        (torch.randn(4, 8), {"float8_dtype": torch.float8_e5m2}, TypeError, "float8_dtype must be one of"),
        ([[1.0]], {}, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input(x, kwargs, error, match):
    with pytest.raises(error, match=match):
        quantize_rowwise_rows(x.to(DEVICE) if isinstance(x, torch.Tensor) else x, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16384, 5120), (65536, 7168)])
def test_benchmark_shapes_bitwise(shape):
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s = quantize_rowwise_rows(x)
    rq, rs = ref_quantize_rowwise(x, torch.float8_e4m3fn, False)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert_fp8_equal(q, rq)
