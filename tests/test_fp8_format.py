from __future__ import annotations

import pytest
import torch

from kernels_helion.fp8_format import abs_amax, abs_nan_as_inf


def _special_values() -> torch.Tensor:
    # Both zeros, subnormals, the extremes, both infinities and NaNs of several payloads and signs.
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x00400000, -0x7FFFFFFF - 1], dtype=torch.int32)
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-40, 1.17e-38, 3.4e38, -3.4e38, float("inf"), float("-inf")], dtype=torch.float32
    )
    return torch.cat([specials, bits.view(torch.float32)])


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("with_nan", [False, True])
def test_abs_amax_matches_float_amax(dim, with_nan):
    # abs_amax reduces integer bits instead of floats: it must give the float amax bit for bit,
    # NaN as +Inf, whatever the signs, zeros, subnormals and NaN payloads.
    torch.manual_seed(0)
    v = torch.randn(37, 53) * torch.logspace(-40, 30, 53)
    specials = _special_values()
    if not with_nan:
        specials = specials[~specials.isnan()]
    rows = torch.randint(0, 37, (specials.numel(),))
    cols = torch.randint(0, 53, (specials.numel(),))
    v[rows, cols] = specials
    expected = torch.amax(abs_nan_as_inf(v), dim=dim)
    assert torch.equal(abs_amax(v, dim=dim).view(torch.int32), expected.view(torch.int32))
    assert expected.isposinf().any()  # the infinities (and NaNs) reached some amaxes
