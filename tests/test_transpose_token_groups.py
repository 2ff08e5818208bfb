from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import FP8_DTYPES
from kernels_helion.token_groups import padded_token_count
from kernels_helion.transpose_token_groups import transpose_to_token_groups
from tests.reference import ref_pad_token_columns
from tests.reference_grouped_linear import group_bounds
from tests.support import DEVICE, group_sizes, offsets_from_sizes, poison_torch_empty


def _random_fp8(m: int, k: int, dtype: torch.dtype = torch.float8_e4m3fn, high: int = 256) -> torch.Tensor:
    """Random bytes ``< high`` as FP8: every bit pattern, NaN encodings included, when ``high`` is 256."""
    return torch.randint(0, high, (m, k), dtype=torch.uint8, device=DEVICE).view(dtype)


def _reference(t: torch.Tensor, offs: torch.Tensor, alignment: int) -> torch.Tensor:
    """Bytes of the expected output: routed tokens' rows as padded-layout columns, zeros elsewhere."""
    routed = torch.zeros(t.shape[::-1], dtype=torch.uint8, device=t.device)
    for start, end in group_bounds(offs):
        routed[:, start:end] = t.view(torch.uint8)[start:end].t()
    # With alignment 1 the layout is the plain one: M columns.
    return ref_pad_token_columns(routed, offs, alignment)[:, : padded_token_count(t.size(0), offs.size(0), alignment)]


def _check(t: torch.Tensor, offs: torch.Tensor, alignment: int = 128) -> None:
    out = transpose_to_token_groups(t, offs, alignment)
    assert out.dtype == t.dtype and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), _reference(t, offs, alignment))


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_matches_reference(dtype):
    # Empty groups, a one-token group, unaligned sizes, tokens past offs[-1].
    _check(_random_fp8(200, 45, dtype), offsets_from_sizes([0, 1, 37, 0, 150]))


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_group_size_kinds(kind):
    _check(_random_fp8(300, 24), offsets_from_sizes(group_sizes(295, 6, kind)))


@pytest.mark.parametrize("alignment", [1, 16, 48])
def test_other_alignments(alignment):
    # The token tile is cut to a divisor of the alignment (down to one token).
    sizes = [0, 1, 37, 16, 0, 90]
    _check(_random_fp8(sum(sizes) + 11, 40), offsets_from_sizes(sizes), alignment)


def test_out_of_range_offsets_are_clamped():
    _check(_random_fp8(120, 16), torch.tensor([-5, 50, 90, 400], dtype=torch.int32, device=DEVICE))


def test_bad_offsets_stay_in_bounds():
    # Decreasing ends overlap groups: the output is unspecified but sized as usual.
    out = transpose_to_token_groups(_random_fp8(100, 24), torch.tensor([100, 0, 100], dtype=torch.int32, device=DEVICE), 16)
    assert out.shape == (24, (-(-100 // 16) + 3) * 16)


@pytest.mark.parametrize("block_sizes", [[16, 32], [32, 16]])
def test_every_output_byte_is_written(monkeypatch, block_sizes):
    # Several tiles each way, partial last ones; a byte no program writes stays 0xFF,
    # which the input (bytes < 255) never holds.
    poison_torch_empty(monkeypatch)
    config = helion.Config(block_sizes=block_sizes, num_warps=4, num_stages=1)
    with forced_config("transpose_to_token_groups", config):
        _check(_random_fp8(75, 70, high=255), offsets_from_sizes([0, 9, 1, 40]), 32)


def test_no_tokens_or_columns():
    offs = offsets_from_sizes([0, 0])
    out = transpose_to_token_groups(_random_fp8(0, 8), offs)
    assert out.shape == (8, 256) and (out.view(torch.uint8) == 0).all()
    assert transpose_to_token_groups(_random_fp8(5, 0), offsets_from_sizes([2, 5])).shape == (0, 384)


_OFFS = torch.tensor([4, 8], dtype=torch.int32)
_FP8 = torch.randn(8, 4).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "t, offs, kwargs, error, match",
    [
        (torch.randn(8, 4, dtype=torch.bfloat16), _OFFS, {}, TypeError, "t must have dtype"),
        (_FP8[None], _OFFS, {}, ValueError, "t must be 2-D"),
        (torch.randn(4, 8).to(torch.float8_e4m3fn).t(), _OFFS, {}, ValueError, "t must be contiguous"),
        (_FP8, torch.tensor([4, 8]), {}, TypeError, "offs must have dtype"),
        (_FP8, _OFFS[None], {}, ValueError, "offs must be 1-D"),
        (_FP8, _OFFS, {"group_alignment": 0}, ValueError, "group_alignment must be an int >= 1"),
    ],
)
def test_bad_input(t, offs, kwargs, error, match):
    with pytest.raises(error, match=match):
        transpose_to_token_groups(t.to(DEVICE), offs.to(DEVICE), **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("m, k, groups, kind", [(32768, 7168, 8, "skewed"), (65536, 7168, 32, "uniform"), (32768, 2048, 16, "uniform")])
def test_benchmark_shapes_bitwise(m, k, groups, kind):
    _check(_random_fp8(m, k), offsets_from_sizes(group_sizes(m, groups, kind)))
