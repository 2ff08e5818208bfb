from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import FP8_DTYPES, quantize_rowwise_rows, quantize_rowwise_rows_and_cols_grouped
from kernels_helion.quantize_rowwise import DEFAULT_CONFIG
from tests.reference import ref_quantize_rowwise
from tests.reference_grouped_linear import group_bounds
from tests.support import DEVICE, assert_fp8_equal, offsets_from_sizes, poison_torch_empty


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


def _per_row(row_multipliers: torch.Tensor, offs: torch.Tensor, m: int) -> torch.Tensor:
    """``(M, K)``: each row's group's multipliers, 1 past ``offs[-1]`` (host-side reference)."""
    per_row = torch.ones(m, row_multipliers.shape[1], device=row_multipliers.device)
    for g, (start, end) in enumerate(group_bounds(offs)):
        per_row[start:end] = row_multipliers[g]
    return per_row


# Empty groups, a one-row group, unaligned sizes, rows past offs[-1]; K with a head and a tail.
FOLD_SIZES = [0, 1, 37, 0, 150]


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_row_multipliers_fold_each_rows_group(float8_dtype, pow2, rows_per_program, monkeypatch):
    """The folded dgrad's rows in one read: bitwise the reference on ``x * multipliers[group]`` and the
    rowwise form of the two-pass quantizer given the same multipliers."""
    x = (torch.randn(200, 45, device=DEVICE) * torch.rand(200, 1, device=DEVICE) * 30).to(torch.bfloat16)
    offs = offsets_from_sizes(FOLD_SIZES)
    multipliers = torch.rand(len(FOLD_SIZES), 45, device=DEVICE) * 8 + 1e-3
    multipliers[3] = float("inf")  # an empty group's multipliers are never read
    config = helion.Config(**{**DEFAULT_CONFIG.config, "block_sizes": [rows_per_program]})
    with forced_config("quantize_rowwise_rows", config), monkeypatch.context() as patch:
        poison_torch_empty(patch)
        q, s = quantize_rowwise_rows(x, float8_dtype, pow2, offs, multipliers)
    eq, es = ref_quantize_rowwise(x.float() * _per_row(multipliers, offs, 200), float8_dtype, pow2)
    torch.testing.assert_close(s, es, rtol=0, atol=0)
    assert_fp8_equal(q, eq)
    tq, ts, _, _ = quantize_rowwise_rows_and_cols_grouped(x, offs, float8_dtype, pow2, row_multipliers=multipliers)
    torch.testing.assert_close(s, ts, rtol=0, atol=0)
    assert_fp8_equal(q, tq)


def test_nan_row_multiplier_stays_in_its_group():
    x = torch.randn(200, 45, device=DEVICE, dtype=torch.bfloat16)
    offs = offsets_from_sizes(FOLD_SIZES)
    multipliers = torch.rand(len(FOLD_SIZES), 45, device=DEVICE) + 0.5
    multipliers[2, 3] = float("nan")
    _, s = quantize_rowwise_rows(x, offs=offs, row_multipliers=multipliers)
    in_group = torch.zeros(200, dtype=torch.bool, device=DEVICE)
    in_group[1:38] = True
    assert torch.isinf(s[in_group]).all() and torch.isfinite(s[~in_group]).all()


@pytest.mark.parametrize(
    "x, kwargs, error, match",
    [
        (torch.randn(8, 4), {"offs": torch.tensor([8], dtype=torch.int32)}, ValueError, "given together"),
        (torch.randn(8, 4), {"row_multipliers": torch.ones(1, 4)}, ValueError, "given together"),
        (torch.randn(8, 4), {"offs": torch.tensor([8], dtype=torch.int32), "row_multipliers": torch.ones(1, 3)},
         ValueError, r"row_multipliers must have shape \(1, 4\)"),
        (torch.randn(8, 4), {"offs": torch.tensor([8], dtype=torch.int64), "row_multipliers": torch.ones(1, 4)},
         TypeError, "offs must have dtype"),
        (torch.randn(4, 8, dtype=torch.float64), {}, TypeError, "x must have dtype"),
        (torch.randn(2, 4, 8), {}, ValueError, "x must be 2-D"),
        (torch.randn(8, 4).t(), {}, ValueError, "x must be contiguous"),
        (torch.randn(4, 0), {}, ValueError, "at least one column"),
        (torch.randn(4, 8), {"float8_dtype": torch.float8_e5m2}, TypeError, "float8_dtype must be one of"),
        ([[1.0]], {}, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input(x, kwargs, error, match):
    kwargs = {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
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


@pytest.mark.cuda
def test_row_multipliers_at_qwen3_width_bitwise():
    """The folded rows of the fused up-projection's gradient (128 experts, 2 x 768 columns) against the two-pass form."""
    x = torch.randn(65536 - 100, 1536, device=DEVICE, dtype=torch.bfloat16)
    offs = offsets_from_sizes([(65536 - 100 - g) // 128 if g % 5 else 0 for g in range(128)])
    multipliers = torch.rand(128, 1536, device=DEVICE) * 1e-3
    q, s = quantize_rowwise_rows(x, offs=offs, row_multipliers=multipliers)
    tq, ts, _, _ = quantize_rowwise_rows_and_cols_grouped(x, offs, row_multipliers=multipliers)
    torch.testing.assert_close(s, ts, rtol=0, atol=0)
    assert_fp8_equal(q, tq)
