from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import (
    to_blocked_scales,
    to_blocked_scales_grouped,
    to_blocked_scales_k_groups,
    to_blocked_scales_per_expert,
)
from tests.support import DEVICE, group_sizes, offsets_from_sizes


def ref_to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """From the rule: 128x4 tiles of 512 bytes, (r, c) at (r % 32) * 16 + (r // 32) * 4 + c, tiles row-major."""
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    tile = (r // 128) * (padded_cols // 4) + c // 4
    rr, cc = r % 128, c % 4
    byte = tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc
    out = torch.zeros(padded_rows * padded_cols, dtype=scales.dtype)
    out[byte.flatten()] = scales.cpu().flatten()
    return out.view(padded_rows, padded_cols).to(scales.device)


def ref_to_blocked_grouped(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group (offs clamped, running max) blocked on its own from a row that is a multiple of 128."""
    rows, cols = scales.shape
    out = torch.zeros((-(-rows // 128) * 128 + offs.numel() * 128, -(-cols // 4) * 4), dtype=scales.dtype)
    starts, start, dst = [], 0, 0
    for o in offs.tolist():
        end = max(start, min(max(o, 0), rows))
        starts.append(dst)
        block = ref_to_blocked(scales[start:end].cpu())
        out[dst : dst + block.size(0)] = block
        dst += block.size(0)
        start = end
    return out.to(scales.device), torch.tensor(starts, dtype=torch.int32, device=scales.device)


def ref_to_blocked_k_groups(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column group (offs clamped, running max) blocked alone, from byte (start col rounded to 4) * padded rows."""
    rows, cols = scales.shape
    padded_rows = -(-rows // 128) * 128
    out = torch.zeros(padded_rows * (-(-cols // 4) * 4 + offs.numel() * 4), dtype=scales.dtype)
    starts, start, dst = [], 0, 0
    for o in offs.tolist():
        end = max(start, min(max(o, 0), cols))
        starts.append(dst)
        block = ref_to_blocked(scales[:, start:end].cpu()).flatten()
        out[dst * padded_rows : dst * padded_rows + block.numel()] = block
        dst += -(-(end - start) // 4) * 4
        start = end
    return out.view(padded_rows, -1).to(scales.device), torch.tensor(starts, dtype=torch.int32, device=scales.device)


def _offs2() -> torch.Tensor:
    return offsets_from_sizes([2])


def _scales(*shape: int) -> torch.Tensor:
    return torch.randint(1, 255, shape, dtype=torch.uint8, device=DEVICE)


def test_hand_computed_positions():
    s = _scales(130, 5)
    flat = to_blocked_scales(s).flatten()
    assert flat.numel() == 256 * 8
    # (row, col) -> byte: 2 column tiles per tile row; tile (1, 0) starts at 1024.
    for (r, c), byte in {
        (0, 0): 0, (1, 0): 16, (32, 0): 4, (33, 2): 22, (127, 3): 511,
        (0, 4): 512, (128, 0): 1024, (129, 4): 1552,
    }.items():
        assert flat[byte] == s[r, c], (r, c, byte)
    assert (flat[512 + 1] == 0) and (flat[1552 + 1] == 0)  # padding columns
    assert (flat[1024 + 2 * 16] == 0)  # padding row 130


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (300, 12), (64, 33)])
def test_2d_matches_reference(shape):
    s = _scales(*shape)
    out = to_blocked_scales(s)
    assert out.is_contiguous()
    assert torch.equal(out, ref_to_blocked(s))


def test_e8m0_dtype_is_kept():
    s = _scales(40, 6).view(torch.float8_e8m0fnu)
    out = to_blocked_scales(s)
    assert out.dtype == torch.float8_e8m0fnu
    assert torch.equal(out.view(torch.uint8), ref_to_blocked(s.view(torch.uint8)))


def test_per_expert_matches_reference():
    s = _scales(3, 140, 7)
    out = to_blocked_scales_per_expert(s)
    assert out.shape == (3, 256, 8)
    for e in range(3):
        assert torch.equal(out[e], ref_to_blocked(s[e]))


def test_transposed_views_match_reference():
    # quantize_mx_cols's scales are the transposed view of block-major (M // 32, K) storage.
    s = _scales(9, 140).t()
    assert torch.equal(to_blocked_scales(s), ref_to_blocked(s))
    per_expert = _scales(3, 7, 140).transpose(1, 2)
    out = to_blocked_scales_per_expert(per_expert)
    for e in range(3):
        assert torch.equal(out[e], ref_to_blocked(per_expert[e]))
    offs = offsets_from_sizes([0, 37, 90])
    out, starts = to_blocked_scales_grouped(s, offs)
    ref_out, ref_starts = ref_to_blocked_grouped(s, offs)
    assert torch.equal(out, ref_out) and torch.equal(starts, ref_starts)


@pytest.mark.parametrize(
    "sizes",
    [[0, 1, 37, 0, 150], [128, 128], [300], [1]],  # empty, one-token, unaligned, aligned; tail tokens dropped
)
def test_grouped_matches_reference(sizes):
    s = _scales(sum(sizes) + 9, 6)
    offs = offsets_from_sizes(sizes)
    out, starts = to_blocked_scales_grouped(s, offs)
    ref_out, ref_starts = ref_to_blocked_grouped(s, offs)
    assert torch.equal(starts, ref_starts) and starts.dtype == torch.int32
    assert out.shape == ref_out.shape and torch.equal(out, ref_out)


@pytest.mark.parametrize("kind", ["skewed", "empty", "unaligned"])
def test_grouped_group_size_kinds(kind):
    s = _scales(400, 4)
    offs = offsets_from_sizes(group_sizes(395, 5, kind))
    out, starts = to_blocked_scales_grouped(s, offs)
    ref_out, ref_starts = ref_to_blocked_grouped(s, offs)
    assert torch.equal(starts, ref_starts) and torch.equal(out, ref_out)


def test_grouped_bad_offsets_are_clamped():
    s = _scales(200, 4)
    offs = torch.tensor([-3, 150, 100, 500], dtype=torch.int32, device=DEVICE)
    out, starts = to_blocked_scales_grouped(s, offs)
    ref_out, ref_starts = ref_to_blocked_grouped(s, offs)
    assert torch.equal(starts, ref_starts) and torch.equal(out, ref_out)


def _many_group_sizes(pattern: tuple[int, ...], groups: int) -> list[int]:
    return [pattern[g % len(pattern)] for g in range(groups)]


# 40 groups (past the power of two 32): empty groups, groups of 1, groups ending mid-tile and on a tile edge.
_MANY_ROW_GROUPS = _many_group_sizes((0, 1, 130, 5, 128, 127, 33, 0), 40)
_MANY_COL_GROUPS = _many_group_sizes((0, 1, 3, 4, 5, 9, 0, 2), 40)


def test_grouped_many_groups():
    s = _scales(sum(_MANY_ROW_GROUPS) + 9, 5)
    offs = offsets_from_sizes(_MANY_ROW_GROUPS)
    out, starts = to_blocked_scales_grouped(s, offs)
    ref_out, ref_starts = ref_to_blocked_grouped(s, offs)
    assert torch.equal(starts, ref_starts) and torch.equal(out, ref_out)


def test_k_groups_many_groups():
    s = _scales(sum(_MANY_COL_GROUPS) + 3, 130).t()
    offs = offsets_from_sizes(_MANY_COL_GROUPS)
    out, starts = to_blocked_scales_k_groups(s, offs)
    ref_out, ref_starts = ref_to_blocked_k_groups(s, offs)
    assert torch.equal(starts, ref_starts) and torch.equal(out, ref_out)


@pytest.mark.parametrize("block_sizes", [[1, 1], [2, 4], [4, 1]])
def test_block_sizes_give_the_same_bytes(block_sizes):
    # A program's tiles may span several groups, the tail and the output's edges.
    config = helion.Config(block_sizes=block_sizes, num_warps=4, num_stages=1)
    rows = _scales(sum(_MANY_ROW_GROUPS[:12]) + 9, 13)
    row_offs = offsets_from_sizes(_MANY_ROW_GROUPS[:12])
    cols = _scales(sum(_MANY_COL_GROUPS[:12]) + 3, 300).t()
    col_offs = offsets_from_sizes(_MANY_COL_GROUPS[:12])
    with forced_config("to_blocked_scales_grouped", config):
        assert torch.equal(to_blocked_scales_grouped(rows, row_offs)[0], ref_to_blocked_grouped(rows, row_offs)[0])
        experts = _scales(3, 140, 7)
        blocked = to_blocked_scales_per_expert(experts)
        assert all(torch.equal(blocked[e], ref_to_blocked(experts[e])) for e in range(3))
    with forced_config("to_blocked_scales_k_groups", config):
        assert torch.equal(to_blocked_scales_k_groups(cols, col_offs)[0], ref_to_blocked_k_groups(cols, col_offs)[0])


_real_empty = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    # The kernels allocate their outputs with torch.empty: poison it, so a byte no program writes shows.
    out = _real_empty(*args, **kwargs)
    return out.fill_(0xAB) if out.dtype == torch.uint8 else out


def test_every_output_byte_is_written(monkeypatch):
    rows = _scales(sum(_MANY_ROW_GROUPS) + 9, 5)
    row_offs = offsets_from_sizes(_MANY_ROW_GROUPS)
    cols = _scales(sum(_MANY_COL_GROUPS) + 3, 130).t()
    col_offs = offsets_from_sizes(_MANY_COL_GROUPS)
    experts = _scales(2, 130, 7)
    expected = (
        ref_to_blocked_grouped(rows, row_offs)[0],
        ref_to_blocked_k_groups(cols, col_offs)[0],
        torch.stack([ref_to_blocked(e) for e in experts]),
    )
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", _poisoned_empty)
        actual = (
            to_blocked_scales_grouped(rows, row_offs)[0],
            to_blocked_scales_k_groups(cols, col_offs)[0],
            to_blocked_scales_per_expert(experts),
        )
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_k_groups_hand_computed_positions():
    s = _scales(130, 10)
    flat, starts = to_blocked_scales_k_groups(s, offsets_from_sizes([3, 0, 6]))  # column 9 is past offs[-1]
    assert flat.shape == (256, 12 + 3 * 4) and starts.tolist() == [0, 4, 4]
    flat = flat.flatten()
    # Group 0: columns 0..2, one column tile, bytes from 0. Group 2: columns 3..8, two
    # column tiles, bytes from 4 * 256 = 1024, row tile 1 after 2 * 512 bytes.
    for (r, c), byte in {
        (0, 0): 0, (1, 0): 16, (32, 1): 5, (127, 2): 510, (129, 2): 512 + 16 + 2,
        (0, 3): 1024, (33, 6): 1024 + 16 + 4 + 3, (0, 7): 1536, (129, 8): 1024 + 1024 + 512 + 16 + 1,
    }.items():
        assert flat[byte] == s[r, c], (r, c, byte)
    assert flat[3] == 0 and flat[512 + 16 + 3] == 0  # group 0's padding column
    assert flat[1024 + 1024 + 2 * 16] == 0  # padding row 130
    assert (flat[(4 + 8) * 256 :] == 0).all()  # past the last group


@pytest.mark.parametrize(
    "shape, sizes",
    [((200, 40), [0, 3, 0, 14, 22]), ((128, 8), [4, 4]), ((64, 33), [33]), ((300, 9), [1, 1, 1])],
)
def test_k_groups_match_reference(shape, sizes):
    s = _scales(*shape)
    offs = offsets_from_sizes(sizes)
    out, starts = to_blocked_scales_k_groups(s, offs)
    ref_out, ref_starts = ref_to_blocked_k_groups(s, offs)
    assert torch.equal(starts, ref_starts) and starts.dtype == torch.int32
    assert out.shape == ref_out.shape and torch.equal(out, ref_out)


def test_k_groups_of_transposed_wgrad_scales_and_bad_offsets():
    # The wgrad operands' scales are (blocks, features) row-major: their .t() is laid out as is.
    s = _scales(45, 140).t()
    for offs in (offsets_from_sizes([10, 0, 30]), torch.tensor([-2, 30, 20, 99], dtype=torch.int32, device=DEVICE)):
        out, starts = to_blocked_scales_k_groups(s, offs)
        ref_out, ref_starts = ref_to_blocked_k_groups(s, offs)
        assert torch.equal(starts, ref_starts) and torch.equal(out, ref_out)
    e8m0 = to_blocked_scales_k_groups(s.view(torch.float8_e8m0fnu), offs)[0]
    assert e8m0.dtype == torch.float8_e8m0fnu and torch.equal(e8m0.view(torch.uint8), out)


@pytest.mark.cuda
@pytest.mark.parametrize("cols, groups", [(64, 16), (160, 8), (224, 40)])
def test_benchmark_shapes_bitwise(cols, groups, monkeypatch):
    # Benchmark-size scales (rows of 32768 tokens, grouped cols of their 1024 token blocks), skewed groups
    # with an empty one, tokens past the last group; outputs poisoned.
    sizes = group_sizes(32768 - 100, groups, "skewed")
    sizes[1] = 0
    rows = _scales(32768, cols)
    offs = offsets_from_sizes(sizes)
    block_sizes = [s // 32 for s in sizes]
    features = _scales(sum(block_sizes) + 3, cols * 32).t()
    block_offs = offsets_from_sizes(block_sizes)
    experts = _scales(4, 2048, cols)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", _poisoned_empty)
        out, starts = to_blocked_scales_grouped(rows, offs)
        k_out, k_starts = to_blocked_scales_k_groups(features, block_offs)
        per_expert = to_blocked_scales_per_expert(experts)
    for actual, expected in (
        ((out, starts), ref_to_blocked_grouped(rows, offs)),
        ((k_out, k_starts), ref_to_blocked_k_groups(features, block_offs)),
    ):
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert all(torch.equal(per_expert[e], ref_to_blocked(experts[e])) for e in range(4))


def test_empty():
    assert to_blocked_scales(_scales(0, 4)).shape == (0, 4)
    out, starts = to_blocked_scales_grouped(_scales(0, 3), offsets_from_sizes([0, 0]))
    assert out.shape == (256, 4) and (out == 0).all() and starts.tolist() == [0, 0]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: to_blocked_scales(torch.zeros(4, 4)), TypeError, "scales must have dtype"),
        (lambda: to_blocked_scales(_scales(2, 4, 4)), ValueError, "scales must be 2-D"),
        (lambda: to_blocked_scales_per_expert(_scales(4, 4)), ValueError, "scales must be 3-D"),
        (lambda: to_blocked_scales_grouped(_scales(4, 4), offsets_from_sizes([2]).long()), TypeError, "offs must have dtype"),
        (lambda: to_blocked_scales_k_groups(_scales(4, 4, 4), _offs2()), ValueError, "scales must be 2-D"),
        (lambda: to_blocked_scales_k_groups(_scales(4, 4).float(), _offs2()), TypeError, "scales must have dtype"),
        (lambda: to_blocked_scales_k_groups(_scales(4, 4), _offs2()[:0]), ValueError, "at least one group end"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
