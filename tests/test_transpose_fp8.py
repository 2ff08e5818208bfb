from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import FP8_DTYPES, transpose_fp8
from tests.support import DEVICE, poison_torch_empty


def _random_fp8(shape: tuple[int, int, int], dtype: torch.dtype, high: int = 256) -> torch.Tensor:
    """Random bytes ``< high`` as FP8: every bit pattern, NaN encodings included, when ``high`` is 256."""
    return torch.randint(0, high, shape, dtype=torch.uint8, device=DEVICE).view(dtype)


def _check(t: torch.Tensor) -> None:
    out = transpose_fp8(t)
    assert out.dtype == t.dtype and out.is_contiguous()
    assert out.shape == (t.size(0), t.size(2), t.size(1))
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8).transpose(1, 2))


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 45, 70), (1, 130, 3), (3, 17, 129)])
def test_matches_transpose(dtype, shape):
    _check(_random_fp8(shape, dtype))


@pytest.mark.parametrize("block_sizes", [[16, 32], [32, 16]])
def test_partial_tiles_cover_everything(monkeypatch, block_sizes):
    # Several tiles each way, partial last ones; an output byte no program writes stays 0xFF,
    # which the input (bytes < 255) never holds.
    poison_torch_empty(monkeypatch)
    config = helion.Config(block_sizes=block_sizes, num_warps=4, num_stages=1)
    with forced_config("transpose_fp8", config):
        _check(_random_fp8((2, 45, 70), torch.float8_e4m3fn, high=255))


def test_empty_tensor():
    out = transpose_fp8(torch.empty((2, 0, 5), dtype=torch.float8_e4m3fn, device=DEVICE))
    assert out.shape == (2, 5, 0)


@pytest.mark.parametrize(
    "t, error, match",
    [
        (torch.randn(2, 4, 8, dtype=torch.bfloat16), TypeError, "t must have dtype"),
        (torch.randn(4, 8).to(torch.float8_e4m3fn), ValueError, "t must be 3-D"),
        (torch.randn(2, 8, 4).to(torch.float8_e4m3fn).transpose(1, 2), ValueError, "t must be contiguous"),
        ("t", TypeError, "t must be a torch.Tensor"),
    ],
)
def test_bad_input(t, error, match):
    with pytest.raises(error, match=match):
        transpose_fp8(t.to(DEVICE) if isinstance(t, torch.Tensor) else t)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 2048, 7168), (16, 8192, 5120), (16, 1536, 2048)])
def test_benchmark_shapes(shape):
    _check(_random_fp8(shape, torch.float8_e4m3fn))
