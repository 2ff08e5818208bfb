"""MXFP8 wgrad grouped GEMM (``grouped_mm_wgrad_mx``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_wgrad_mx, quantize_mx_cols_grouped
from tests.gemm_formats import make_mx_wgrad
from tests.reference_mx import ref_exp2, ref_grouped_mm_wgrad_mx
from tests.support import DEVICE, group_sizes, offsets_from_sizes, sqnr_db

make_inputs = make_mx_wgrad


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 accumulation of exact FP8 products per block, then the output dtype's rounding.
    atol = 4e-3 * float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, g", [(150, 48, 64, 4), (97, 40, 24, 3)])
def test_matches_reference(kind, m, n, k, g):
    offs = offsets_from_sizes(group_sizes(m - 7, g, kind))  # tokens past offs[-1] are ignored
    a_t, sa, b_t, sb, block_offs = make_inputs(m, n, k, offs)
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs)
    assert out.dtype == torch.bfloat16 and out.shape == (g, n, k)
    assert_close(out, ref_grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs))


def test_groups_inside_one_cell_and_across_many():
    # Three groups inside cell 0, one spanning cells 0..3 (partial first and last), a one-token group.
    offs = offsets_from_sizes([2, 5, 9, 100, 1])
    a_t, sa, b_t, sb, block_offs = make_inputs(130, 32, 16, offs)
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs, out_dtype=torch.float32)
    assert_close(out, ref_grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs))


def test_quantized_pipeline_against_exact_product():
    """``quantize_mx_cols_grouped`` of grad_out and x, then the wgrad: MXFP8 error only."""
    m, n, k = 200, 64, 96
    sizes = [60, 0, 1, 77, 50]
    offs = offsets_from_sizes(sizes)
    grad_out, x = torch.randn(m, n, device=DEVICE), torch.randn(m, k, device=DEVICE)
    got, go_scales, block_offs = quantize_mx_cols_grouped(grad_out, offs)
    xt, x_scales, x_block_offs = quantize_mx_cols_grouped(x, offs)
    assert torch.equal(block_offs, x_block_offs)
    out = grouped_mm_wgrad_mx(got, go_scales, xt, x_scales, offs, block_offs, out_dtype=torch.float32)
    assert_close(out, ref_grouped_mm_wgrad_mx(got, go_scales, xt, x_scales, offs))
    start = 0
    for g, end in enumerate(offs.tolist()):
        exact = grad_out[start:end].double().T @ x[start:end].double()
        assert (out[g] == 0).all() if end == start else sqnr_db(out[g], exact) >= 25
        start = end


def test_empty_group_is_exactly_zero_even_with_nan_scales():
    offs = offsets_from_sizes([20, 0, 30])
    a_t, sa, b_t, sb, block_offs = make_inputs(60, 32, 16, offs)
    sa[block_offs[1]:] = 255  # rows after group 1's (empty) start: read by group 2 only
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs, out_dtype=torch.float32)
    assert (out[1] == 0).all()
    assert out[2].isnan().all() and not out[0].isnan().any()


def test_nan_scale_touches_its_block_only():
    offs = offsets_from_sizes([40, 50])
    a_t, sa, b_t, sb, block_offs = make_inputs(90, 32, 16, offs)
    sa[0, 3] = 255  # group 0's first block, row 3 of a_t
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs, out_dtype=torch.float32)
    expected = torch.zeros(2, 32, 16, dtype=torch.bool, device=DEVICE)
    expected[0, 3, :] = True
    assert torch.equal(out.isnan(), expected)


def test_accumulates_into_fp32_out():
    offs = offsets_from_sizes([40, 0, 1, 50])
    a_t, sa, b_t, sb, block_offs = make_inputs(100, 32, 48, offs)
    out = torch.randn(4, 32, 48, device=DEVICE) * 100
    out[1, 0, 0] = -0.0
    before = out.clone()
    result = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs, out=out)
    assert result is out
    expected = before.double() + ref_grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-3 * float(expected.abs().amax()))
    assert torch.equal(out[1].view(torch.int32), before[1].view(torch.int32)), "empty group: out bitwise unchanged"


def test_e8m0_dtype_scales():
    offs = offsets_from_sizes(group_sizes(120, 3, "unaligned"))
    a_t, sa, b_t, sb, block_offs = make_inputs(130, 48, 32, offs)
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs)
    e8m0 = torch.float8_e8m0fnu
    assert torch.equal(out, grouped_mm_wgrad_mx(a_t, sa.view(e8m0), b_t, sb.view(e8m0), offs, block_offs))


def ref_wgrad_mx_clamped(a_t, a_scales, b_t, b_scales, offs, block_offs) -> torch.Tensor:  # noqa: ANN001
    """float64 wgrad as the kernel reads any offsets and block map: group ``g`` has the tokens ``[s, e)`` with
    ``s = offs[g-1]`` and ``e = offs[g]`` clamped into ``[0, M]`` (none when ``e <= s``); its block in cell ``c``
    has the scale row ``block_offs[g-1] + c - s // 32`` clamped into the scale tensors."""
    m, last_row = a_t.shape[1], a_scales.shape[0] - 1
    ends = [min(max(o, 0), m) for o in offs.tolist()]
    out = torch.zeros(len(ends), a_t.shape[0], b_t.shape[0], dtype=torch.float64, device=a_t.device)
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        first_row = 0 if g == 0 else int(block_offs[g - 1])
        for cell in range(s // 32, (e - 1) // 32 + 1) if e > s else ():
            t0, t1 = max(s, 32 * cell), min(e, 32 * cell + 32)
            row = min(max(first_row + cell - s // 32, 0), last_row)
            a = a_t[:, t0:t1].double() * ref_exp2(a_scales[row])[:, None]
            b = b_t[:, t0:t1].double() * ref_exp2(b_scales[row])[:, None]
            out[g] += a @ b.T
    return out


@pytest.mark.parametrize(
    "offs",
    [[16, 32, 48, 64], [-5, 1000, 10, 70]],
    ids=["valid-offsets", "overlapping-offsets"],
)
def test_bad_block_map_reads_clamped_scale_rows(offs):
    """A bad block map (below 0, past the scale rows) with valid or overlapping offsets (the groups [0, 0),
    [0, 64), [64, 64) and [10, 64)): scale rows clamped into the scale tensors, every group its own tokens."""
    offs = torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    a_t, sa, b_t, sb, _ = make_inputs(64, 16, 24, offsets_from_sizes([16, 16, 16, 16]))
    bad_blocks = torch.tensor([-100, 3, 10**6, 2], dtype=torch.int32, device=DEVICE)
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, bad_blocks, out_dtype=torch.float32)
    assert_close(out, ref_wgrad_mx_clamped(a_t, sa, b_t, sb, offs, bad_blocks))


def _bad(**overrides):
    offs = offsets_from_sizes([16, 32])
    a_t, sa, b_t, sb, block_offs = make_inputs(48, 16, 32, offs)
    args = dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offs, block_offs=block_offs)
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"a_scales": lambda d: d["a_scales"].float()}, TypeError, "a_scales must have dtype"),
        ({"a_scales": lambda d: d["a_scales"][0]}, ValueError, "a_scales must be 2-D"),
        ({"a_scales": lambda d: d["a_scales"][:0]}, ValueError, "at least one scale row"),
        ({"a_scales": lambda d: d["a_scales"][:, :-1].contiguous()}, ValueError, r"a_scales must have shape \(4, 16\)"),
        ({"b_scales": lambda d: d["b_scales"][:-1]}, ValueError, r"b_scales must have shape \(4, 32\)"),
        ({"block_offs": lambda d: d["block_offs"][:1]}, ValueError, "block_offs must have one entry per group"),
        ({"block_offs": lambda d: d["block_offs"].long()}, TypeError, "block_offs must have dtype"),
        ({"out": lambda d: torch.zeros(2, 16, 32, device=DEVICE).bfloat16()}, TypeError, "out must have dtype"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_wgrad_mx(**_bad(**overrides))


BENCH_SHAPES = [  # (M tokens, N, K, G)
    (32768, 2048, 7168, 8),
    (32768, 1536, 2048, 16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("m, n, k, g", BENCH_SHAPES)
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shapes(m, n, k, g, kind):
    offs = offsets_from_sizes(group_sizes(m - 100, g, kind))
    a_t, sa, b_t, sb, block_offs = make_inputs(m, n, k, offs)
    out = grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs)
    assert torch.equal(out, grouped_mm_wgrad_mx(a_t, sa, b_t, sb, offs, block_offs)), "not bitwise deterministic"
    rows = slice(0, 128)  # a block of (N, K) per group keeps the reference small
    ref = ref_grouped_mm_wgrad_mx(a_t[rows], sa[:, rows].contiguous(), b_t[rows], sb[:, rows].contiguous(), offs)
    assert_close(out[:, rows, rows], ref)
