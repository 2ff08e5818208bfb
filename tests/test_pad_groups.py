from __future__ import annotations

import pytest
import torch

from kernels_helion import pad_token_groups, unpad_token_groups
from tests.support import DEVICE, group_sizes, offsets_from_sizes


def ref_pad_token_groups(x: torch.Tensor, offs: torch.Tensor, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group g of x at row padded_offs[g-1] (groups rounded up to ``alignment``), then the tail, zeros elsewhere.

    Group bounds: offs clamped into [0, M], made non-decreasing by a running max.
    """
    m = x.size(0)
    ends, end = [], 0
    for o in offs.tolist():
        end = max(end, min(max(o, 0), m))
        ends.append(end)
    out = torch.zeros((m + len(ends) * alignment, x.size(1)), dtype=x.dtype, device=x.device)
    padded_ends, src, dst = [], 0, 0
    for end in ends:
        out[dst : dst + end - src] = x[src:end]
        dst += -(-(end - src) // alignment) * alignment
        src = end
        padded_ends.append(dst)
    out[dst : dst + m - src] = x[src:]
    return out, torch.tensor(padded_ends, dtype=torch.int32, device=x.device)


def _check_round_trip(x, offs, alignment):
    xp, padded_offs = pad_token_groups(x, offs, alignment)
    rxp, rpo = ref_pad_token_groups(x, offs, alignment)
    assert padded_offs.dtype == torch.int32 and padded_offs.device == x.device
    assert torch.equal(padded_offs, rpo)
    assert xp.dtype == x.dtype and torch.equal(xp.view(torch.uint8), rxp.view(torch.uint8))
    assert (padded_offs % alignment == 0).all()
    back = unpad_token_groups(xp, offs, padded_offs, x.size(0))
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("alignment", [16, 32, 128])
def test_round_trip_edge_groups(alignment):
    # Empty groups, a one-token group, unaligned sizes, 13 tokens past offs[-1] (kept at the end).
    x = torch.randn(201, 24, device=DEVICE, dtype=torch.bfloat16)
    _check_round_trip(x, offsets_from_sizes([0, 1, 37, 0, 150]), alignment)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_round_trip_group_size_kinds(kind):
    x = torch.randn(300, 40, device=DEVICE)
    _check_round_trip(x, offsets_from_sizes(group_sizes(295, 6, kind)), 32)


def test_aligned_sizes_and_single_group_single_token():
    x = torch.randn(64, 16, device=DEVICE)
    _check_round_trip(x, offsets_from_sizes([16, 32, 16]), 16)  # already aligned: only the bound's zeros
    _check_round_trip(torch.randn(1, 3, device=DEVICE), offsets_from_sizes([1]), 16)


def test_fp8_and_uint8_rows_move_as_bytes():
    x = (torch.randn(70, 32, device=DEVICE) * 100).to(torch.float8_e4m3fn)
    _check_round_trip(x, offsets_from_sizes([3, 40, 20]), 16)
    _check_round_trip(torch.randint(0, 256, (70, 5), dtype=torch.uint8, device=DEVICE), offsets_from_sizes([9, 0, 50]), 32)


def test_out_of_range_and_decreasing_offsets_are_clamped():
    x = torch.randn(120, 8, device=DEVICE)
    offs = torch.tensor([-5, 50, 30, 90, 400], dtype=torch.int32, device=DEVICE)
    _check_round_trip(x, offs, 16)


def test_layout_hand_checked():
    x = torch.arange(1, 11, device=DEVICE, dtype=torch.float32)[:, None].repeat(1, 2)  # rows 1..10
    xp, padded_offs = pad_token_groups(x, offsets_from_sizes([3, 0, 5]), 4)  # 2 tail tokens
    assert padded_offs.tolist() == [4, 4, 12]
    assert xp.shape == (10 + 3 * 4, 2)
    assert xp[:, 0].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 9, 10] + [0] * 8


def test_empty_tokens_and_columns():
    xp, padded_offs = pad_token_groups(torch.randn(0, 8, device=DEVICE), offsets_from_sizes([0, 0]), 16)
    assert xp.shape == (32, 8) and (xp == 0).all() and padded_offs.tolist() == [0, 0]
    xp, padded_offs = pad_token_groups(torch.randn(5, 0, device=DEVICE), offsets_from_sizes([2, 3]), 16)
    assert xp.shape == (37, 0) and padded_offs.tolist() == [16, 32]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, o: pad_token_groups(x, o, 0), ValueError, "alignment must be a positive int"),
        (lambda x, o: pad_token_groups(x, o, 16.0), ValueError, "alignment must be a positive int"),
        (lambda x, o: pad_token_groups(x, o.long(), 16), TypeError, "offs must have dtype"),
        (lambda x, o: pad_token_groups(x[None], o, 16), ValueError, "x must be 2-D"),
        (lambda x, o: pad_token_groups(x.double(), o, 16), TypeError, "x must have dtype"),
        (lambda x, o: pad_token_groups(x, o[:0], 16), ValueError, "offs must hold at least one group end"),
        (lambda x, o: unpad_token_groups(x, o, o[:1], 4), ValueError, "padded_offs must have the shape of offs"),
        (lambda x, o: unpad_token_groups(x, o, o, 9), ValueError, r"num_tokens \(9\) must not exceed"),
        (lambda x, o: unpad_token_groups(x, o, o, -1), ValueError, "num_tokens must be a non-negative int"),
        (lambda x, o: unpad_token_groups(x, o, o.long(), 4), TypeError, "padded_offs must have dtype"),
    ],
)
def test_bad_input(call, error, match):
    x = torch.randn(8, 4, device=DEVICE)
    with pytest.raises(error, match=match):
        call(x, offsets_from_sizes([2, 3]))
