from __future__ import annotations

import pytest
import torch

from kernels_helion import quantize_mx_rows, quantize_mx_cols, quantize_mx_expert_weights
from tests.reference import ref_e8m0, ref_quantize_mx
from tests.support import DEVICE, assert_fp8_equal

ROUNDINGS = ["rceil", "floor"]


def _blocks_with_magnitudes(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random data whose 32-element blocks along the last dim span 2**-40 .. 2**40."""
    exponents = torch.randint(-40, 41, (*shape[:-1], shape[-1] // 32, 1), device=DEVICE).float()
    x = torch.randn(*shape[:-1], shape[-1] // 32, 32, device=DEVICE) * torch.pow(2.0, exponents)
    return x.flatten(-2).to(dtype)


def _check(q, s, rq, rs, block_major_scales=False):
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert_fp8_equal(q, rq)
    assert q.is_contiguous()
    # quantize_mx_cols's scales are the transposed view of contiguous (M // 32, K) scales.
    assert (s.transpose(-2, -1) if block_major_scales else s).is_contiguous()


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32), (37, 96), (64, 64)])
def test_rows_matches_reference(rounding, in_dtype, shape):
    x = _blocks_with_magnitudes(*shape, dtype=in_dtype)
    _check(*quantize_mx_rows(x, rounding), *ref_quantize_mx(x, rounding))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("shape", [(32, 1), (96, 37), (64, 48)])
def test_cols_matches_reference(rounding, shape):
    x = _blocks_with_magnitudes(shape[1], shape[0]).t().contiguous()
    _check(*quantize_mx_cols(x, rounding), *ref_quantize_mx(x.t(), rounding), block_major_scales=True)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cols_special_values_and_input_dtypes(rounding, in_dtype):
    # The transposing kernel takes a 16-bit block's amax on its own bits: NaN, +-Inf, a zero
    # block and a block past a partial token tile (96 tokens, 64 a tile by default) in each dtype.
    x = torch.randn(96, 40, device=DEVICE) * 3
    x[5, 3] = float("nan")
    x[40, 7] = float("inf")
    x[70, 9] = float("-inf")
    x[32:64, 11] = 0.0
    x[64:, 12] = 1e-3
    x = x.to(in_dtype)
    _check(*quantize_mx_cols(x, rounding), *ref_quantize_mx(x.t(), rounding), block_major_scales=True)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_expert_weights_match_reference(rounding):
    w = _blocks_with_magnitudes(3, 40, 64)
    _check(*quantize_mx_expert_weights(w, rounding), *ref_quantize_mx(w, rounding))
    wt = _blocks_with_magnitudes(3, 40, 64).transpose(1, 2).contiguous()  # (E, N=64, K=40)
    q, s = quantize_mx_expert_weights(wt, rounding, transposed=True)
    assert q.shape == (3, 40, 64) and s.shape == (3, 40, 2)
    _check(q, s, *ref_quantize_mx(wt.transpose(1, 2), rounding))


# (block amax, rceil exponent, floor exponent), hand-computed:
# rceil = ceil(log2(amax / 448)) + 127, floor = floor(log2(amax)) - 8 + 127.
HAND_COMPUTED = [
    (448.0, 127, 127),
    (449.0, 128, 127),
    (1.0, 119, 119),
    (1.75, 119, 119),  # 1.75 / 448 = 2**-8 exactly
    (1.75 + 2**-23, 120, 119),  # just above: rounds up
    (1.9, 120, 119),
    (0.0, 0, 0),  # zero block: smallest scale 2**-127
    (2.0**-120, 0, 0),  # below the smallest scale's range: clamped
    (2.0**-118, 1, 1),  # 2**-118 / 448 in (2**-127, 2**-126]
    (3.0e38, 247, 246),
    (float("inf"), 255, 255),
    (float("nan"), 255, 255),
]


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_hand_computed_scales_and_special_blocks(rounding):
    x = torch.randn(len(HAND_COMPUTED), 64, device=DEVICE)
    for row, (amax, _, _) in enumerate(HAND_COMPUTED):
        finite = 0 < amax < float("inf")
        # Other elements below amax / 2; the amax itself negative: the sign must not matter.
        x[row, :32] = torch.rand(32, device=DEVICE) * (0.5 * amax if finite else 0.0)
        x[row, 7] = -amax
    q, s = quantize_mx_rows(x, rounding)
    expected = [r[1] if rounding == "rceil" else r[2] for r in HAND_COMPUTED]
    assert s[:, 0].tolist() == expected
    assert ref_e8m0(torch.tensor([r[0] for r in HAND_COMPUTED]), rounding).tolist() == expected
    _check(q, s, *ref_quantize_mx(x, rounding))
    assert (q[6, :32].float() == 0).all()  # zero block -> zeros
    assert q[-2:, :32].float().isnan().all()  # NaN scale -> NaN elements
    assert (s[:, 1] < 255).all() and not q[:, 32:].float().isnan().any()  # other blocks unaffected
    # FLOOR saturates 1.9 * 2**8 to 448; RCEIL never saturates.
    # -1.9 * 2**7 = -243.2 rounds to -240 (step 16 there).
    assert q[5, 7].float().item() == (-448.0 if rounding == "floor" else -240.0)


def test_dequantized_error_is_small():
    x = torch.randn(64, 128, device=DEVICE) * 5
    for rounding in ROUNDINGS:
        q, s = quantize_mx_rows(x, rounding)
        deq = q.float() * torch.pow(2.0, s.float() - 127).repeat_interleave(32, dim=1)
        assert ((deq - x).norm() / x.norm()) < 0.05


def test_empty():
    q, s = quantize_mx_rows(torch.randn(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 2)
    q, s = quantize_mx_cols(torch.randn(0, 8, device=DEVICE))
    assert q.shape == (8, 0) and s.shape == (8, 0) and s.t().is_contiguous()


@pytest.mark.parametrize(
    "fn, x, kwargs, error, match",
    [
        (quantize_mx_rows, torch.randn(4, 48), {}, ValueError, r"x's K \(dim 1\) must be a multiple of the MX block size 32"),
        (quantize_mx_cols, torch.randn(48, 32), {}, ValueError, r"x's M \(dim 0\) must be a multiple"),
        (quantize_mx_rows, torch.randn(4, 32), {"rounding": "even"}, ValueError, "rounding must be one of"),
        (quantize_mx_rows, torch.randn(4, 32, dtype=torch.float64), {}, TypeError, "x must have dtype"),
        (quantize_mx_rows, torch.randn(64, 4).t(), {}, ValueError, "x must be contiguous"),
        (quantize_mx_cols, torch.randn(2, 32, 32), {}, ValueError, "x must be 2-D"),
        (quantize_mx_expert_weights, torch.randn(2, 32, 40), {}, ValueError, r"w's K \(dim 2\)"),
        (quantize_mx_expert_weights, torch.randn(2, 40, 32), {"transposed": True}, ValueError, r"w's N \(dim 1\)"),
        (quantize_mx_expert_weights, torch.randn(32, 32), {}, ValueError, "w must be 3-D"),
    ],
)
def test_bad_input(fn, x, kwargs, error, match):
    with pytest.raises(error, match=match):
        fn(x.to(DEVICE), **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_benchmark_shapes_bitwise(rounding):
    x = torch.randn(16384, 5120, device=DEVICE, dtype=torch.bfloat16) * 3
    _check(*quantize_mx_rows(x, rounding), *ref_quantize_mx(x, rounding))
    _check(*quantize_mx_cols(x, rounding), *ref_quantize_mx(x.t(), rounding), block_major_scales=True)
