from __future__ import annotations

import pytest
import torch

import kernels_helion.quantize_blockwise as quantize_blockwise
from kernels_helion import (
    FP8_DTYPES,
    quantize_blockwise_rows,
    quantize_blockwise_cols,
    quantize_blockwise_cols_grouped,
    quantize_blockwise_rows_and_cols,
    quantize_blockwise_rows_and_cols_grouped,
    quantize_blockwise_weights,
    quantize_blockwise_weights_both_layouts,
    quantize_blockwise_weights_transposed,
)
from tests.reference import ref_amax, ref_cast, ref_scale
from tests.support import DEVICE, assert_fp8_equal, group_sizes, offsets_from_sizes, poison_torch_empty


def ref_act(x: torch.Tensor, float8_dtype, pow2, block=128):
    """(M, K) -> fp8 (M, K), scales (M, ceil(K/block)): one scale per 1 x block block of a row."""
    m, k = x.shape
    kb = -(-k // block)
    padded = torch.zeros(m, kb * block, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = ref_scale(ref_amax(padded.view(m, kb, block), 2), float8_dtype, pow2)
    return ref_cast(x, scale.repeat_interleave(block, 1)[:, :k], float8_dtype), scale


def ref_cols(x: torch.Tensor, float8_dtype, pow2, block=128):
    """(M, K) -> fp8 (K, M) contiguous, scales (ceil(M/block), K): block x 1 blocks of each column."""
    q_t, scale_t = ref_act(x.t(), float8_dtype, pow2, block)
    return q_t.contiguous(), scale_t.t().contiguous()


def ref_weight(w: torch.Tensor, float8_dtype, pow2, block=128):
    """(..., N, K) -> fp8 (..., N, K), scales (..., ceil(N/block), ceil(K/block)): square blocks."""
    *batch, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(*batch, nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*batch, nb, block, kb, block)
    scale = ref_scale(ref_amax(blocks, (-3, -1)), float8_dtype, pow2)
    full = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
    return ref_cast(w, full, float8_dtype), scale


def ref_cols_grouped(x: torch.Tensor, offs: torch.Tensor, float8_dtype, pow2, block=128):
    """Per-group ref_cols; blocks start at each group's start; scale rows packed group after group.

    Group ends are offs clamped into [0, M], running max (group g is [ends[g-1], ends[g])).
    The fp8 output is in block space: block row ``r`` owns columns ``[r*block, (r+1)*block)``,
    zero past its group's last token; a group's block rows are consecutive, so its tokens
    are the columns ``row*block + (0 .. size)``.
    """
    m, k = x.shape
    ends = torch.cummax(offs.long().cpu().clamp(0, m), 0).values.tolist()
    rows = -(-m // block) + len(ends)
    q_t = torch.zeros(k, rows * block, dtype=float8_dtype, device=x.device)
    scales = torch.zeros(rows, k, device=x.device)
    block_starts, row = [], 0
    for g, end in enumerate(ends):
        start = ends[g - 1] if g > 0 else 0
        block_starts.append(row)
        if end > start:
            gq, gs = ref_cols(x[start:end], float8_dtype, pow2, block)
            q_t[:, row * block : row * block + end - start] = gq
            scales[row : row + gs.shape[0]] = gs
            row += gs.shape[0]
    return q_t, scales, torch.tensor(block_starts, dtype=torch.int32, device=x.device)


def assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def random_input(shape, dtype=torch.bfloat16):
    # Magnitudes vary across rows and columns so that every block gets its own scale.
    scale = torch.rand(shape[-2], 1, device=DEVICE) * torch.rand(1, shape[-1], device=DEVICE) * 100
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 300), (130, 257)])
def test_act_all_layouts_match_reference(float8_dtype, pow2, shape):
    x = random_input(shape)
    rq, rs = ref_act(x, float8_dtype, pow2)
    rqt, rst = ref_cols(x, float8_dtype, pow2)
    q, s = quantize_blockwise_rows(x, float8_dtype, pow2)
    assert_fp8_equal(q, rq)
    assert_scales_equal(s, rs)
    qt, st = quantize_blockwise_cols(x, float8_dtype, pow2)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(st, rst)
    dq, ds, dqt, dst = quantize_blockwise_rows_and_cols(x, float8_dtype, pow2)
    assert_fp8_equal(dq, rq)
    assert_scales_equal(ds, rs)
    assert_fp8_equal(dqt, rqt)
    assert_scales_equal(dst, rst)
    assert qt.is_contiguous() and st.is_contiguous() and dqt.is_contiguous()


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_rows_and_cols_other_input_dtypes_and_block(in_dtype):
    x = random_input((70, 100), in_dtype)
    dq, ds, dqt, dst = quantize_blockwise_rows_and_cols(x, block=32)
    rq, rs = ref_act(x, torch.float8_e4m3fn, False, 32)
    rqt, rst = ref_cols(x, torch.float8_e4m3fn, False, 32)
    assert_fp8_equal(dq, rq)
    assert_scales_equal(ds, rs)
    assert_fp8_equal(dqt, rqt)
    assert_scales_equal(dst, rst)


@pytest.mark.parametrize("m", [5, 8])
def test_act_scales_are_k_block_major_and_tma_aligned(m):
    _, s = quantize_blockwise_rows(random_input((m, 300)))
    padded = -(-m // 4) * 4
    assert s.shape == (m, 3) and s.stride() == (1, padded)
    assert s.t().stride() == (padded, 1)


def test_no_rows():
    x = torch.randn(0, 64, device=DEVICE)
    q, s, qt, st = quantize_blockwise_rows_and_cols(x)
    assert q.shape == (0, 64) and s.shape == (0, 1) and qt.shape == (64, 0) and st.shape == (0, 64)
    gqt, gs, starts = quantize_blockwise_cols_grouped(x, offsets_from_sizes([0, 0]))
    assert gqt.shape == (64, 2 * 128) and (gqt.float() == 0).all()
    assert (gs == 0).all() and gs.shape == (2, 64) and (starts == 0).all()


def test_every_output_element_is_written(monkeypatch):
    poison_torch_empty(monkeypatch)
    x = random_input((130, 136))
    dq, ds, dqt, dst = quantize_blockwise_rows_and_cols(x, block=64)
    rq, rs = ref_act(x, torch.float8_e4m3fn, False, 64)
    rqt, rst = ref_cols(x, torch.float8_e4m3fn, False, 64)
    for actual, expected in ((dq, rq), (dqt, rqt)):
        assert_fp8_equal(actual, expected)
    for actual, expected in ((ds, rs), (dst, rst)):
        assert_scales_equal(actual, expected)
    offs = offsets_from_sizes([70, 0, 1, 40])
    gq, gqs, gqt, gs, starts = quantize_blockwise_rows_and_cols_grouped(x, offs, block=64)
    rgqt, rgs, rstarts = ref_cols_grouped(x, offs, torch.float8_e4m3fn, False, 64)
    assert_fp8_equal(gq, rq)
    assert_scales_equal(gqs, rs)
    assert_fp8_equal(gqt, rgqt)
    assert_scales_equal(gs, rgs)
    wq, ws, wqt, wst = quantize_blockwise_weights_both_layouts(x[None], block=64)
    rwq, rws = ref_weight(x[None], torch.float8_e4m3fn, False, 64)
    assert_fp8_equal(wq, rwq)
    assert_fp8_equal(wqt, rwq.transpose(1, 2).contiguous())
    assert_scales_equal(ws, rws)
    assert_scales_equal(wst, rws.transpose(1, 2).contiguous())


@pytest.mark.parametrize(
    "sizes, m",
    [
        ([130, 0, 1, 127], 258),  # empty group, one-token group, unaligned, exact fit
        ([5, 300, 0], 320),  # tokens past offs[-1], empty last group
        ([0], 40),  # every token past offs[-1]
        ([256], 256),  # one group, block multiple
    ],
)
@pytest.mark.parametrize("float8_dtype, pow2", [(torch.float8_e4m3fn, False), (torch.float8_e4m3fnuz, True)])
def test_cols_grouped_matches_reference(sizes, m, float8_dtype, pow2):
    x = random_input((m, 136))
    offs = offsets_from_sizes(sizes)
    rqt, rs, rstarts = ref_cols_grouped(x, offs, float8_dtype, pow2)
    qt, s, starts = quantize_blockwise_cols_grouped(x, offs, float8_dtype, pow2)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(s, rs)
    assert torch.equal(starts, rstarts)
    dq, ds, dqt, dst, dstarts = quantize_blockwise_rows_and_cols_grouped(x, offs, float8_dtype, pow2)
    rq, rrs = ref_act(x, float8_dtype, pow2)
    assert_fp8_equal(dq, rq)
    assert_scales_equal(ds, rrs)
    assert_fp8_equal(dqt, rqt)
    assert_scales_equal(dst, rs)
    assert torch.equal(dstarts, rstarts)


@pytest.mark.parametrize("kind", ["empty", "one", "unaligned"])
def test_cols_grouped_routed_sizes(kind):
    sizes = group_sizes(200, 5, kind)
    x = random_input((200, 40))
    offs = offsets_from_sizes(sizes)
    qt, s, starts = quantize_blockwise_cols_grouped(x, offs, block=32)
    rqt, rs, rstarts = ref_cols_grouped(x, offs, torch.float8_e4m3fn, False, 32)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(s, rs)
    assert torch.equal(starts, rstarts)


def test_cols_grouped_bad_offsets_stay_in_bounds():
    x = random_input((50, 16))
    # Decreasing and out-of-range values: group ends are clamped into [0, M], running max.
    offs = torch.tensor([40, 10, 500, -3], dtype=torch.int32, device=DEVICE)
    qt, s, starts = quantize_blockwise_cols_grouped(x, offs, block=32)
    assert qt.shape == (16, (2 + 4) * 32) and s.shape == (2 + 4, 16) and starts.shape == (4,)
    rqt, rs, rstarts = ref_cols_grouped(x, offs, torch.float8_e4m3fn, False, 32)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(s, rs)
    assert torch.equal(starts, rstarts)


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (130, 257), (2, 129, 100)])
def test_weight_all_layouts_match_reference(float8_dtype, pow2, shape):
    w = random_input(shape)
    rq, rs = ref_weight(w, float8_dtype, pow2)
    rqt = rq.transpose(-2, -1).contiguous()
    rst = rs.transpose(-2, -1).contiguous()
    q, s = quantize_blockwise_weights(w, float8_dtype, pow2)
    assert_fp8_equal(q, rq)
    assert_scales_equal(s, rs)
    qt, st = quantize_blockwise_weights_transposed(w, float8_dtype, pow2)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(st, rst)
    assert qt.is_contiguous() and st.is_contiguous()
    dq, ds, dqt, dst = quantize_blockwise_weights_both_layouts(w, float8_dtype, pow2)
    assert_fp8_equal(dq, rq)
    assert_scales_equal(ds, rs)
    assert_fp8_equal(dqt, rqt)
    assert_scales_equal(dst, rst)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_weight_layouts_other_input_dtypes(in_dtype):
    w = random_input((2, 129, 100), in_dtype)
    rq, rs = ref_weight(w, torch.float8_e4m3fn, False)
    rqt, rst = rq.transpose(-2, -1).contiguous(), rs.transpose(-2, -1).contiguous()
    qt, st = quantize_blockwise_weights_transposed(w)
    dq, ds, dqt, dst = quantize_blockwise_weights_both_layouts(w)
    for q, r in ((qt, rqt), (dq, rq), (dqt, rqt)):
        assert_fp8_equal(q, r)
    for s, r in ((st, rst), (ds, rs), (dst, rst)):
        assert_scales_equal(s, r)


@pytest.mark.parametrize("shape", [(130, 257), (2, 129, 100)])
def test_transposed_weight_through_fp8_bytes_is_the_same(monkeypatch, shape):
    """The path float32 weights take on a GPU (the forward form's bytes transposed) gives the kernel's bits."""
    w = random_input(shape, torch.float32)
    kernel = quantize_blockwise_weights_both_layouts(w, torch.float8_e4m3fn, True)
    kernel_t = quantize_blockwise_weights_transposed(w, torch.float8_e4m3fn, True)
    monkeypatch.setattr(quantize_blockwise, "transposes_through_fp8_bytes", lambda src: True)
    for a, b in zip(quantize_blockwise_weights_both_layouts(w, torch.float8_e4m3fn, True), kernel):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    qt, st = quantize_blockwise_weights_transposed(w, torch.float8_e4m3fn, True)
    assert torch.equal(qt.view(torch.uint8), kernel_t[0].view(torch.uint8)) and torch.equal(st, kernel_t[1])


def test_zero_blocks_have_finite_scale_and_zero_output():
    x = random_input((130, 200))
    x[:, 128:] = 0  # second 1x128 block of every row
    x[128:] = 0  # second 128x1 block of every column
    q, s, qt, st = quantize_blockwise_rows_and_cols(x)
    assert torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(st).all() and (st > 0).all()
    assert (q[:, 128:].float() == 0).all() and (qt[:, 128:].float() == 0).all()
    wq, ws = quantize_blockwise_weights(x)
    assert torch.isfinite(ws).all() and (ws > 0).all()
    assert (wq[128:].float() == 0).all() and (wq[:, 128:].float() == 0).all()


def test_nan_and_inf_propagate():
    x = random_input((130, 200))
    x[3, 5] = float("nan")
    x[129, 150] = float("inf")
    q, s, qt, st = quantize_blockwise_rows_and_cols(x)
    assert torch.isinf(s[3, 0]) and torch.isinf(s[129, 1]) and torch.isfinite(s).sum() == s.numel() - 2
    assert torch.isinf(st[0, 5]) and torch.isinf(st[1, 150]) and torch.isfinite(st).sum() == st.numel() - 2
    assert torch.isnan(q[3, 5].float()) and torch.isnan(qt[5, 3].float()) and torch.isnan(q[129, 150].float())
    wq, ws = quantize_blockwise_weights(x)
    assert torch.isinf(ws[0, 0]) and torch.isinf(ws[1, 1]) and torch.isfinite(ws[[0, 1], [1, 0]]).all()
    assert torch.isnan(wq[3, 5].float()) and torch.isnan(wq[129, 150].float())
    offs = offsets_from_sizes([3, 127])
    gqt, gs, _ = quantize_blockwise_cols_grouped(x, offs)
    # Group 1 (tokens 3..129) is one block, block row 1 (columns 128..254 of gqt);
    # tokens 130.. are past offs[-1] (zero output).
    assert torch.isinf(gs[1, 5]) and torch.isinf(gs[1, 150]) and torch.isfinite(gs).sum() == gs.numel() - 2
    assert torch.isnan(gqt[5, 128].float()) and torch.isnan(gqt[150, 254].float())
    assert gqt.shape == (200, 4 * 128) and torch.isnan(gqt.float()).sum() == 2
    assert (gqt[:, 3:128].float() == 0).all() and (gqt[:, 255:].float() == 0).all()


_X = torch.randn(8, 16)
_OFFS = torch.tensor([8], dtype=torch.int32)
_STRIDED_OFFS = torch.tensor([4, 0, 8, 0], dtype=torch.int32)[::2]


@pytest.mark.parametrize(
    "fn, args, error, match",
    [
        (quantize_blockwise_rows, (_X.double(),), TypeError, "x must have dtype"),
        (quantize_blockwise_rows, (_X[None],), ValueError, "x must be 2-D"),
        (quantize_blockwise_rows_and_cols, (_X.t(),), ValueError, "x must be contiguous"),
        (quantize_blockwise_cols, (_X[:, :0],), ValueError, "at least one column"),
        (quantize_blockwise_rows, (_X, torch.float8_e5m2), TypeError, "float8_dtype must be one of"),
        (quantize_blockwise_rows, (_X, torch.float8_e4m3fn, False, 100), ValueError, "block must be one of"),
        (quantize_blockwise_rows, ([[1.0]],), TypeError, "x must be a torch.Tensor"),
        (quantize_blockwise_cols_grouped, (_X, torch.tensor([8])), TypeError, "offs must have dtype"),
        (quantize_blockwise_cols_grouped, (_X, _OFFS[:0]), ValueError, "at least one"),
        (quantize_blockwise_cols_grouped, (_X, _OFFS[None]), ValueError, "offs must be 1-D"),
        (quantize_blockwise_cols_grouped, (_X, _STRIDED_OFFS), ValueError, "offs must be contiguous"),
        (quantize_blockwise_rows_and_cols_grouped, (_X, torch.tensor([8.0])), TypeError, "offs must have dtype"),
        (quantize_blockwise_rows_and_cols_grouped, (_X.t(), _OFFS), ValueError, "x must be contiguous"),
        (quantize_blockwise_weights, (_X[None, None],), ValueError, "w must be 2-D .* or 3-D"),
        (quantize_blockwise_weights_both_layouts, (_X.t(),), ValueError, "w must be contiguous"),
        (quantize_blockwise_weights_transposed, (_X.long(),), TypeError, "w must have dtype"),
        (quantize_blockwise_weights, (_X[:0],), ValueError, "no empty dimension"),
        (quantize_blockwise_weights, ([[1.0]],), TypeError, "w must be a torch.Tensor"),
    ],
)
def test_bad_input(fn, args, error, match):
    # .to() another device makes a strided (non-dense) 1-D tensor contiguous: rebuild the stride there.
    args = tuple(
        (a.repeat_interleave(2).to(DEVICE)[::2] if a.dim() == 1 and not a.is_contiguous() else a.to(DEVICE))
        if isinstance(a, torch.Tensor) else a
        for a in args
    )
    with pytest.raises(error, match=match):
        fn(*args)


@pytest.mark.cuda
def test_offsets_on_other_device():
    with pytest.raises(ValueError, match="offs must be on"):
        quantize_blockwise_cols_grouped(_X.to(DEVICE), _OFFS)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16384, 7168), (8192, 5120)])
def test_benchmark_shapes_bitwise(shape):
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s, qt, st = quantize_blockwise_rows_and_cols(x)
    rq, rs = ref_act(x, torch.float8_e4m3fn, False)
    rqt, rst = ref_cols(x, torch.float8_e4m3fn, False)
    assert_fp8_equal(q, rq)
    assert_scales_equal(s, rs)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(st, rst)
    wq, ws, wqt, wst = quantize_blockwise_weights_both_layouts(x)
    rwq, rws = ref_weight(x, torch.float8_e4m3fn, False)
    assert_fp8_equal(wq, rwq)
    assert_scales_equal(ws, rws)
    assert_fp8_equal(wqt, rwq.t().contiguous())
    offs = offsets_from_sizes(group_sizes(shape[0], 16, "skewed"))
    gqt, gs, starts = quantize_blockwise_cols_grouped(x, offs)
    rgqt, rgs, rstarts = ref_cols_grouped(x, offs, torch.float8_e4m3fn, False)
    assert_fp8_equal(gqt, rgqt)
    assert_scales_equal(gs, rgs)
    assert torch.equal(starts, rstarts)
