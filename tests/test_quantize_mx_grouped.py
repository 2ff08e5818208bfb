from __future__ import annotations

import helion
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from autotune_cache import forced_config
from kernels_helion import (
    quantize_mx_rows,
    quantize_mx_cols,
    quantize_mx_cols_grouped,
    quantize_mx_rows_and_cols_grouped,
)
from tests.reference import ref_quantize_mx
from kernels_helion.quantize_mx_grouped import CELL_HOLDS_BOUNDARY, CELL_PAST_GROUPS, mx_token_blocks
from tests.reference_mx import ref_block_offs, ref_cell_rows, ref_group_ends, ref_quantize_mx_cols_grouped
from tests.support import DEVICE, assert_fp8_equal, group_sizes, offsets_from_sizes

ROUNDINGS = ["rceil", "floor"]


def _tokens(m: int, c: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random tokens whose magnitudes vary by token and column (2**-20 .. 2**20), so block scales differ."""
    token_exp = torch.randint(-10, 11, (m, 1), device=DEVICE).float()
    col_exp = torch.randint(-10, 11, (1, c), device=DEVICE).float()
    return (torch.randn(m, c, device=DEVICE) * torch.exp2(token_exp + col_exp)).to(dtype)


def _check(actual, expected):
    xt, scales, block_offs = actual
    rxt, rscales, rblock_offs = expected
    assert torch.equal(block_offs, rblock_offs) and block_offs.dtype == torch.int32
    assert scales.shape == rscales.shape and scales.dtype == torch.uint8 and scales.is_contiguous()
    assert torch.equal(scales, rscales)
    assert xt.is_contiguous()
    assert_fp8_equal(xt, rxt)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_edge_groups_match_reference(rounding):
    # Empty groups, a one-token group, groups inside one cell, across cells, and 13 tokens past offs[-1].
    x = _tokens(120, 64)
    offs = offsets_from_sizes([0, 1, 3, 0, 40, 50])
    _check(quantize_mx_cols_grouped(x, offs, rounding), ref_quantize_mx_cols_grouped(x, offs, rounding))


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_group_size_kinds(kind):
    x = _tokens(150, 32, torch.float32)
    offs = offsets_from_sizes(group_sizes(143, 5, kind))
    _check(quantize_mx_cols_grouped(x, offs), ref_quantize_mx_cols_grouped(x, offs, "rceil"))


@pytest.mark.parametrize("block_c", [32, 64])
def test_column_tiles_and_poisoned_outputs(block_c, monkeypatch):
    # Group ends on cell starts (32, 96, 128) and inside cells, three ends in one cell (130, 131, 140),
    # cells past the last end, and (block_c = 64) a column tile past C = 96. Every output buffer starts
    # as 0xAB bytes: the kernel must write each byte, the rows of no block included.
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        # Not the kernel compiler's tracing tensors (fake, or with symbolic sizes).
        if not isinstance(out, FakeTensor) and all(isinstance(size, int) for size in out.shape) and out.numel():
            out.reshape(-1).view(torch.uint8).fill_(0xAB)
        return out

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    x = _tokens(300, 96)
    config = helion.Config(block_sizes=[block_c], num_warps=2, num_stages=1)
    families = [("quantize_mx_cols_grouped", quantize_mx_cols_grouped), ("quantize_mx_rows_and_cols_grouped", quantize_mx_rows_and_cols_grouped)]
    rq, rq_scales = ref_quantize_mx(x, "floor")
    # The second offsets route no token: every scale row is a spare one (0).
    for offs in (offsets_from_sizes([32, 64, 32, 2, 1, 9, 60, 41]), offsets_from_sizes([0, 0, 0, 0, 0, 0, 0])):
        for family, quantize in families:
            with forced_config(family, config):
                out = quantize(x, offs, "floor")
            _check(out[-3:], ref_quantize_mx_cols_grouped(x, offs, "floor"))
            if family == "quantize_mx_rows_and_cols_grouped":
                assert_fp8_equal(out[0], rq)
                assert torch.equal(out[1], rq_scales)


def test_block_map_hand_computed():
    # Groups [0,5) [5,5) [5,40) [40,66) of 70 tokens: cells {0}, {}, {0,1}, {1,2}.
    x = _tokens(70, 32)
    xt, scales, block_offs = quantize_mx_cols_grouped(x, offsets_from_sizes([5, 0, 35, 26]))
    assert block_offs.tolist() == [1, 1, 3, 5]
    assert scales.shape == (3 + 4, 32)
    assert (scales[5:] == 0).all()  # rows of no block
    assert (xt[:, 66:].float() == 0).all()  # tokens past offs[-1]
    # Row 3 is group 3's block in cell 1: tokens 40..63 only.
    block = torch.zeros(32, 32, device=DEVICE)
    block[:, :24] = x[40:64].t().float()
    assert torch.equal(scales[3], ref_quantize_mx(block, "rceil")[1][:, 0])


def test_token_blocks_hand_computed():
    # Groups [0, 64) and [64, 90) of 100 tokens: cells 0 and 1 are group 0's blocks (rows 0, 1),
    # cell 2 holds group 1's end, cell 3 lies past it.
    ends, block_offs, cell_rows = mx_token_blocks(offsets_from_sizes([64, 26]), 100)
    assert ends.tolist() == [64, 90] and block_offs.tolist() == [2, 3]
    assert cell_rows.tolist() == [0, 1, CELL_HOLDS_BOUNDARY, CELL_PAST_GROUPS] == [0, 1, -1, -2]


# 257 groups (512 lanes) on the GPU only: the interpreter runs the G + 1 programs' lane scans one by one (minutes).
@pytest.mark.parametrize("num_groups", [1, 7, 40, 64, pytest.param(257, marks=pytest.mark.cuda)])
def test_token_blocks_match_reference(num_groups):
    # Random ends past both bounds, a decreasing run, repeats (empty groups), M not a multiple of 32.
    m = 1001 + num_groups
    gen = torch.Generator().manual_seed(num_groups)
    offs = torch.randint(-40, m + 40, (num_groups,), generator=gen, dtype=torch.int32).sort().values
    offs[num_groups // 3 : num_groups // 3 + 5] = offs[num_groups // 3 : num_groups // 3 + 5].flip(0)
    offs = offs.to(DEVICE)
    ends, block_offs, cell_rows = mx_token_blocks(offs, m)
    assert ends.tolist() == ref_group_ends(offs, m)
    assert torch.equal(block_offs, ref_block_offs(offs, m))
    assert cell_rows.dtype == torch.int32 and torch.equal(cell_rows, ref_cell_rows(offs, m))


def test_rows_and_cols_matches_single_kernels_bitwise():
    x = _tokens(100, 96)
    offs = offsets_from_sizes([30, 0, 33, 20])
    q, q_scales, *grouped = quantize_mx_rows_and_cols_grouped(x, offs, "floor")
    rq, rs = quantize_mx_rows(x, "floor")
    assert_fp8_equal(q, rq)
    assert torch.equal(q_scales, rs)
    _check(tuple(grouped), quantize_mx_cols_grouped(x, offs, "floor"))


def test_one_aligned_group_equals_cols():
    x = _tokens(64, 32)
    xt, scales, block_offs = quantize_mx_cols_grouped(x, offsets_from_sizes([64]))
    rxt, rscales = quantize_mx_cols(x)
    assert_fp8_equal(xt, rxt)
    # The same scales in the same (block-major) storage.
    assert torch.equal(scales[:2], rscales.t()) and rscales.t().is_contiguous() and (scales[2:] == 0).all()
    assert block_offs.tolist() == [2]


def test_nan_and_inf_blocks():
    x = _tokens(64, 64, torch.float32)
    x[3, 5] = float("nan")  # group 0's block in cell 0, column 5
    x[40, 33] = float("inf")  # group 1's block in cell 1, column 33
    offs = offsets_from_sizes([10, 50])
    xt, scales, block_offs = quantize_mx_cols_grouped(x, offs)
    _check((xt, scales, block_offs), ref_quantize_mx_cols_grouped(x, offs, "rceil"))
    assert scales[0, 5] == 255 and xt[5, :10].float().isnan().all()
    assert scales[2, 33] == 255 and xt[33, 32:60].float().isnan().all()
    assert (scales[:3] == 255).sum() == 2  # no other block touched
    assert not xt[5, 10:].float().isnan().any()


def test_bad_offsets_are_clamped():
    x = _tokens(90, 32)
    offs = torch.tensor([-4, 50, 20, 70, 500], dtype=torch.int32, device=DEVICE)
    _check(quantize_mx_cols_grouped(x, offs), ref_quantize_mx_cols_grouped(x, offs, "rceil"))


def test_empty_and_single_token():
    xt, scales, block_offs = quantize_mx_cols_grouped(torch.randn(0, 32, device=DEVICE), offsets_from_sizes([0, 0]))
    assert xt.shape == (32, 0) and scales.shape == (2, 32) and (scales == 0).all() and block_offs.tolist() == [0, 0]
    x = _tokens(1, 32)
    one = offsets_from_sizes([1])
    _check(quantize_mx_cols_grouped(x, one), ref_quantize_mx_cols_grouped(x, one, "rceil"))


def test_non_flat_pid_type_is_refused():
    # Helion's "xyz" and persistent program ids fault this two-loop kernel on the H200.
    x = _tokens(64, 32)
    config = helion.Config(block_sizes=[32], num_warps=1, num_stages=1, pid_type="xyz")
    with forced_config("quantize_mx_cols_grouped", config), pytest.raises(ValueError, match="pid_type 'flat'"):
        quantize_mx_cols_grouped(x, offsets_from_sizes([20, 30]))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, o: quantize_mx_cols_grouped(x[:, :40].contiguous(), o), ValueError, "multiple of the MX block size"),
        (lambda x, o: quantize_mx_cols_grouped(x[:, :0].contiguous(), o), ValueError, r"positive multiple"),
        (lambda x, o: quantize_mx_cols_grouped(x.double(), o), TypeError, "x must have dtype"),
        (lambda x, o: quantize_mx_cols_grouped(x.t(), o), ValueError, "x must be contiguous"),
        (lambda x, o: quantize_mx_cols_grouped(x, o.long()), TypeError, "offs must have dtype"),
        (lambda x, o: quantize_mx_cols_grouped(x, o[:0]), ValueError, "offs must hold at least one group end"),
        (lambda x, o: quantize_mx_rows_and_cols_grouped(x, o, "nearest"), ValueError, "rounding must be one of"),
        (lambda x, o: quantize_mx_rows_and_cols_grouped(x[None], o), ValueError, "x must be 2-D"),
    ],
)
def test_bad_input(call, error, match):
    x = torch.randn(64, 64, device=DEVICE)
    with pytest.raises(error, match=match):
        call(x, offsets_from_sizes([20, 30]))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shape_bitwise(kind):
    m, c, g = 16384, 2048, 16
    x = torch.randn(m, c, device=DEVICE, dtype=torch.bfloat16) * 3
    offs = offsets_from_sizes(group_sizes(m - 100, g, kind))
    q, q_scales, *grouped = quantize_mx_rows_and_cols_grouped(x, offs)
    rq, rs = ref_quantize_mx(x, "rceil")
    assert_fp8_equal(q, rq)
    assert torch.equal(q_scales, rs)
    _check(tuple(grouped), ref_quantize_mx_cols_grouped(x, offs, "rceil"))
