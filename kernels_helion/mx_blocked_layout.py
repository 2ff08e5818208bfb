"""MX scales in the blocked ("swizzled") layout that Blackwell's block-scaled GEMMs read.

A ``(rows, cols)`` e8m0 scale matrix (one row per token or weight row, one
column per 32-element block) is cut into 128x4 tiles; each tile is stored as 512
contiguous bytes with element ``(r, c)`` at byte ``(r % 32) * 16 + (r // 32) * 4 + c``,
and tile ``(tr, tc)`` at byte ``(tr * n_col_tiles + tc) * 512`` (rows of tiles
first). Rows and columns are zero-padded to multiples of 128 and 4. The result
is returned as ``(padded_rows, padded_cols)`` uint8 whose bytes are in that
order (``.flatten()`` gives the 1-D form).

Variants: plain 2-D; per expert ``(E, rows, cols)``; and token groups along the
rows (``offs``), where each group's rows start at a multiple of 128 in the
output (group bounds as in ``kernels_helion.pad_groups``; rows past ``offs[-1]``
belong to no group and are dropped; the output rows are the upper bound
``ceil(rows / 128) * 128 + G * 128``, zero past the last group).

Groups along the columns (``to_blocked_scales_k_groups``, for the wgrad
operands, whose scale columns are token blocks): group ``g``'s columns
``[ends[g-1], ends[g])`` are laid out on their own as ``to_blocked_scales``
would (all rows, its columns zero-padded to a multiple of 4), and placed as one
contiguous run of bytes from ``starts[g] * padded_rows``, where ``starts[g]`` is
the group's first column rounded up to 4 (cumulative widths rounded up to 4);
the output is ``(padded_rows, ceil(cols / 4) * 4 + G * 4)``, zero past the last
group. This is the per-group layout Blackwell's MXFP8 2D x 2D grouped GEMM reads.

The kernels run one program per block of output tiles (no serial walk over
groups or tiles): each finds the group owning its tiles by comparing their first
output row (column) with all group ends at once, gathers the tiles' bytes from
the scale matrix and stores them contiguously; every output byte is written by
exactly one program, zeros where no group's scales land. A grouped layout is one
launch: each program derives the group ends and padded starts from ``offs``
itself (``group_layout``, one lane per group), and the first program also writes
the padded starts that the launcher returns. Against a separate offsets kernel
first, this took 0.3-1.5 us off the 4-12 us these layouts take on the H200
(``docs/experiments.md``).

Tile-sized tensors are broadcast with ``reshape``, not ``t[None, :]``: Helion
makes a reduction dimension of such a slice and later hands it to any reduction
whose size equals the tile's size hint (64), such as the group lanes when there
are 33-64 groups, which then took the tile's mask (a shape error, or wrong lanes
when the sizes agree).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.group_offsets import aligned_group_ends, group_lanes, group_layout, owning_group
from kernels_helion.validation import check_offsets, check_tensor
from kernels_helion.tuning import routed_offsets, vary, warps_for

TILE_ROWS = 128
TILE_COLS = 4

# block_sizes = [column tiles per program, row tiles per program] (512 bytes a tile; column
# tiles vary fastest across programs, so neighbours write neighbouring bytes). 8 x 2 tiles:
# 8 KiB per program, 190-1900 programs at the benchmark shapes (132 SMs on an H100/H200). Untuned.
DEFAULT_CONFIG = helion.Config(block_sizes=[8, 2], num_warps=4, num_stages=1)
# Groups along the columns: the same block_sizes (a program's column tiles of one group in
# one row tile are contiguous in the output); 280-980 programs at the benchmark shapes. Untuned.
K_GROUPS_DEFAULT_CONFIG = helion.Config(block_sizes=[8, 2], num_warps=4, num_stages=1)


def _tile_cells() -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, col)`` over ``(1, 1, 32, 16)``: the cell of a 128x4 tile that its byte ``(i, lane)`` holds.

    Byte ``16 * i + 4 * j + c`` holds row ``32 * j + i``, column ``c``. C-style
    division (``trunc``, ``fmod``; the same on these non-negative lanes) keeps the
    source addresses analysable for vector loads (Triton sees 4 contiguous
    columns, or 32 contiguous rows of a column-major source).
    """
    i = hl.arange(32)[None, None, :, None]
    lane = hl.arange(16)[None, None, None, :]
    return 32 * torch.div(lane, 4, rounding_mode="trunc") + i, torch.fmod(lane, 4)


@helion.kernel(static_shapes=False)
def to_blocked_scales_grouped_kernel(
    scales: torch.Tensor,
    offs: torch.Tensor,
    dst_row_tiles: int,
    grouped: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of ``scales (B, R, C)``: ``(B, dst_row_tiles, ceil(C / 4), 512)`` uint8, and the groups' starts.

    ``grouped``: group ``g`` covers rows ``[ends[g-1], ends[g])`` (``offs`` clamped
    into ``[0, R]``, running max) and starts at the row returned for it (its padded
    start, a multiple of 128) in the output; rows of no group (a group's last-tile
    padding, the tiles after the last group) are zero. Else one group covers all
    ``R`` rows (``offs`` empty, no starts). One program per block of output tiles:
    it finds each row tile's group and source rows, gathers the tiles' bytes and
    stores them contiguously.
    """
    batches, rows, cols = scales.shape
    col_tiles = (cols + 3) // 4
    out = torch.empty([batches, dst_row_tiles, col_tiles, 512], dtype=torch.uint8, device=scales.device)
    group_starts = torch.empty([offs.size(0)], dtype=torch.int32, device=scales.device)
    for tile_ct, tile_rt, tile_b in hl.tile([col_tiles, dst_row_tiles, batches], block_size=[None, None, 1]):
        b = tile_b.begin
        dst_row = tile_rt.index * 128
        if grouped:
            lanes, is_group, ends, padded_ends, padded_sizes = group_layout(offs, rows, 128, groups_pow2, False)
            if (tile_ct.begin == 0) & (tile_rt.begin == 0) & (b == 0):
                hl.store(group_starts, [lanes], padded_ends - padded_sizes, extra_mask=is_group)
            # Row tiles past the last group have no source rows (source end 0).
            src_start, src_end, dst_start, _ = owning_group(
                ends, padded_ends, dst_row, 0, dst_row_tiles * 128, lanes, is_group
            )
            src_first_row = src_start + (dst_row - dst_start)
        else:
            src_first_row = dst_row
            src_end = hl.full([tile_rt], rows, dtype=torch.int32)
        tile_row, tile_col = _tile_cells()
        src_row = src_first_row.reshape([tile_rt.block_size, 1, 1, 1]) + tile_row
        src_col = tile_ct.index.reshape([1, tile_ct.block_size, 1, 1]) * 4 + tile_col
        valid = (src_row < src_end.reshape([tile_rt.block_size, 1, 1, 1])) & (src_col < cols)
        tile_bytes = hl.load(scales, [b, src_row, src_col], extra_mask=valid)
        # Flat 512-byte tiles: a warp stores whole tiles, contiguously.
        out[b, tile_rt, tile_ct, :] = tile_bytes.reshape([tile_rt.block_size, tile_ct.block_size, 512])
    return out, group_starts


@helion.kernel(static_shapes=False)
def to_blocked_scales_k_groups_kernel(
    scales: torch.Tensor,
    offs: torch.Tensor,
    dst_cols: int,
    groups_pow2: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of ``scales (R, C)`` (any strides) grouped along ``C``: ``ceil(R / 128) * 128 * dst_cols`` bytes, and the groups' first columns.

    Group ``g`` covers columns ``[ends[g-1], ends[g])`` (``offs`` clamped into
    ``[0, C]``, running max) and owns the output columns ``[start_g, end_g)``
    (multiples of 4: its width rounded up, cumulated; ``start_g`` is returned), i.e.
    the bytes from ``start_g * padded_rows``, tile ``(rt, ct)`` at
    ``(rt * group_col_tiles + ct) * 512`` in them; the columns after the last group
    (the tail, laid out the same way) are zero. One program per block of (output
    column tile, row tile): every output tile is written once.
    """
    rows, cols = scales.shape
    row_tiles = (rows + 127) // 128
    out = torch.empty([row_tiles * 128 * dst_cols], dtype=torch.uint8, device=scales.device)
    group_col_starts = torch.empty([offs.size(0)], dtype=torch.int32, device=scales.device)
    for tile_ct, tile_rt in hl.tile([dst_cols // 4, row_tiles]):
        lanes, is_group, ends, padded_ends, padded_widths = group_layout(offs, cols, 4, groups_pow2, False)
        if (tile_ct.begin == 0) & (tile_rt.begin == 0):
            hl.store(group_col_starts, [lanes], padded_ends - padded_widths, extra_mask=is_group)
        dst_col = tile_ct.index * 4
        src_start, src_end, dst_start, dst_end = owning_group(ends, padded_ends, dst_col, 0, dst_cols, lanes, is_group)
        tile_row, tile_col = _tile_cells()
        src_row = tile_rt.index.reshape([tile_rt.block_size, 1, 1, 1]) * 128 + tile_row
        src_col = (src_start + dst_col - dst_start).reshape([1, tile_ct.block_size, 1, 1]) + tile_col
        valid = (src_row < rows) & (src_col < src_end.reshape([1, tile_ct.block_size, 1, 1]))
        tile_bytes = hl.load(scales, [src_row, src_col], extra_mask=valid)
        # Flat 512-byte tiles (a warp stores whole tiles, contiguously); tile (rt, ct) of
        # the group is counted from the group's first byte, dst_start * padded rows.
        tile_bytes = tile_bytes.reshape([tile_rt.block_size, tile_ct.block_size, 512])
        rt = tile_rt.index.reshape([tile_rt.block_size, 1, 1])
        group_col_tiles = ((dst_end - dst_start) // 4).reshape([1, tile_ct.block_size, 1])
        group_tile = rt * group_col_tiles + ((dst_col - dst_start) // 4).reshape([1, tile_ct.block_size, 1])
        byte = dst_start.reshape([1, tile_ct.block_size, 1]) * (row_tiles * 128) + group_tile * 512 + hl.arange(512)[None, None, :]
        hl.store(out, [byte], tile_bytes)
    return out, group_col_starts


SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.float8_e8m0fnu)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _blocked(
    scales: torch.Tensor, offs: torch.Tensor, dst_row_tiles: int, grouped: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on ``scales (B, R, C)``: ``(B, dst_row_tiles * 128, ceil(C / 4) * 4)``, scales' dtype, and the groups' starts."""
    require_interpreter_on_cpu(scales)
    batches, rows, cols = scales.shape
    shape = (batches, dst_row_tiles * TILE_ROWS, _ceil_div(cols, TILE_COLS) * TILE_COLS)
    if scales.numel() == 0 or dst_row_tiles == 0:
        blocked = torch.zeros(shape, dtype=scales.dtype, device=scales.device)
        if not grouped:
            return blocked, offs
        # No scales to place: the group starts alone (the padded layout of the row counts).
        return blocked, aligned_group_ends(offs, rows, TILE_ROWS)[2]
    config = select_config("to_blocked_scales_grouped", {"R": rows, "C": cols}, DEFAULT_CONFIG)
    args = (scales.view(torch.uint8), offs, dst_row_tiles, grouped, group_lanes(offs.numel()))
    out, group_starts = launch(to_blocked_scales_grouped_kernel, args, config)
    return out.view(shape).view(scales.dtype), group_starts


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Blocked layout of a ``(rows, cols)`` e8m0 scale matrix (see the module docstring).

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, any strides (``quantize_mx_cols``'s
            are a transposed view).

    Returns:
        ``(ceil(rows / 128) * 128, ceil(cols / 4) * 4)`` of ``scales``' dtype, bytes in blocked order.
    """
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES, contiguous=False)
    return to_blocked_scales_per_expert(scales.unsqueeze(0))[0]


def to_blocked_scales_per_expert(scales: torch.Tensor) -> torch.Tensor:
    """Blocked layout of each expert's scales: ``(E, rows, cols)`` -> ``(E, padded_rows, padded_cols)``.

    Args:
        scales: ``(E, rows, cols)`` uint8 or float8_e8m0fnu, any strides.

    Returns:
        ``(E, ceil(rows / 128) * 128, ceil(cols / 4) * 4)``; expert ``e``'s bytes are
        ``to_blocked_scales(scales[e])``'s.
    """
    check_tensor("scales", scales, ndim=3, dtypes=SCALE_DTYPES, contiguous=False)
    no_groups = torch.empty(0, dtype=torch.int32, device=scales.device)
    return _blocked(scales, no_groups, _ceil_div(scales.size(1), TILE_ROWS), grouped=False)[0]


def to_blocked_scales_grouped(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of token-group scales, each group starting at a multiple of 128 rows.

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, any strides (one row per token).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on scales' device.

    Returns:
        ``(blocked, group_starts)``: ``blocked`` ``(ceil(rows / 128) * 128 + G * 128,
        ceil(cols / 4) * 4)`` with group ``g``'s rows laid out as ``to_blocked_scales``
        of them from row ``group_starts[g]``; ``group_starts`` ``(G,)`` int32 (multiples
        of 128), computed on the device.
    """
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES, contiguous=False)
    check_offsets(offs, scales.device)
    dst_row_tiles = _ceil_div(scales.size(0), TILE_ROWS) + offs.numel()
    blocked, group_starts = _blocked(scales.unsqueeze(0), offs, dst_row_tiles, grouped=True)
    return blocked[0], group_starts


def to_blocked_scales_k_groups(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of scales whose column groups are laid out one after the other (wgrad operands).

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, any strides: for a wgrad
            operand, the ``.t()`` of ``quantize_mx_cols_grouped``'s ``(blocks, C)``
            scales (rows = features, columns = 32-token blocks).
        offs: ``(G,)`` int32 cumulative group ends along the columns (``block_offs``
            for a wgrad operand), on scales' device; clamped into ``[0, cols]`` and
            made non-decreasing on the device.

    Returns:
        ``(blocked, group_col_starts)``: ``blocked`` ``(ceil(rows / 128) * 128,
        ceil(cols / 4) * 4 + G * 4)`` of scales' dtype whose flat bytes hold, for
        each group ``g`` from byte ``group_col_starts[g] * ceil(rows / 128) * 128``,
        ``to_blocked_scales`` of its columns (see the module docstring), zeros
        elsewhere; ``group_col_starts`` ``(G,)`` int32 (multiples of 4), computed on the device.
    """
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES, contiguous=False)
    check_offsets(offs, scales.device)
    require_interpreter_on_cpu(scales)
    rows, cols = scales.shape
    padded_rows = _ceil_div(rows, TILE_ROWS) * TILE_ROWS
    dst_cols = _ceil_div(cols, TILE_COLS) * TILE_COLS + offs.numel() * TILE_COLS
    if padded_rows == 0:
        # No rows to lay out: the group starts alone.
        group_col_starts = aligned_group_ends(offs, cols, TILE_COLS)[2]
        return torch.zeros((0, dst_cols), dtype=scales.dtype, device=scales.device), group_col_starts
    config = select_config("to_blocked_scales_k_groups", {"R": rows, "C": cols}, K_GROUPS_DEFAULT_CONFIG)
    args = (scales.view(torch.uint8), offs, dst_cols, group_lanes(offs.numel()))
    blocked, group_col_starts = launch(to_blocked_scales_k_groups_kernel, args, config)
    return blocked.view(padded_rows, dst_cols).view(scales.dtype), group_col_starts


# Tuning: [column tiles, row tiles] per program (512 bytes a tile): 2-16 KiB.
_TUNING_BLOCKS = [[8, 2], [8, 1], [4, 2], [4, 4], [16, 1], [16, 2], [8, 4], [2, 4]]


def _grouped_tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    # Token-group scales, the recipe's case (the per-expert and plain layouts run the same kernel).
    scales = torch.randint(0, 255, (shape["R"], shape["C"]), dtype=torch.uint8, device=device)
    offs = routed_offsets(shape["R"] - 100, 16, device)
    return lambda: to_blocked_scales_grouped(scales, offs)


def _k_groups_tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    # The wgrad operands' (blocks, features) scales, laid out through their transpose.
    scales = torch.randint(0, 255, (shape["C"], shape["R"]), dtype=torch.uint8, device=device).t()
    offs = routed_offsets(shape["C"] - 16, 16, device)
    return lambda: to_blocked_scales_k_groups(scales, offs)


register_tuning(
    "to_blocked_scales_grouped",
    DEFAULT_CONFIG,
    lambda arch: vary(DEFAULT_CONFIG, block_sizes=_TUNING_BLOCKS, num_warps=warps_for(arch)),
    [{"R": 32768, "C": c} for c in (64, 160, 224)],
    _grouped_tuning_call,
    {"R": 200, "C": 9},
)
register_tuning(
    "to_blocked_scales_k_groups",
    K_GROUPS_DEFAULT_CONFIG,
    lambda arch: vary(K_GROUPS_DEFAULT_CONFIG, block_sizes=_TUNING_BLOCKS, num_warps=warps_for(arch)),
    [{"R": r, "C": 32768 // 32 + 16} for r in (2048, 5120, 7168)],
    _k_groups_tuning_call,
    {"R": 200, "C": 40},
)
