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

Each program owns one (batch, group, strip of column tiles) and walks the
group's row tiles, gathering each 512-byte tile from the scale matrix (groups
along the columns: one (group, strip of row tiles), walking the group's column
tiles).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.pad_groups import aligned_group_ends
from kernels_helion.validation import check_offsets, check_tensor

TILE_ROWS = 128
TILE_COLS = 4

# block_sizes = [column tiles per program, row tiles per step]. Untuned.
DEFAULT_CONFIG = helion.Config(block_sizes=[4, 1], num_warps=4, num_stages=1)
# Groups along the columns: block_sizes = [row tiles per program, column tiles per step]. Untuned.
K_GROUPS_DEFAULT_CONFIG = helion.Config(block_sizes=[4, 1], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def mx_blocked_layout_kernel(
    scales: torch.Tensor,
    group_ends: torch.Tensor,
    dst_group_ends: torch.Tensor,
    dst_row_tiles: int,
    grouped: hl.constexpr,
) -> torch.Tensor:
    """Blocked layout of ``scales (B, R, C)``: ``(B, dst_row_tiles, ceil(C / 4), 32, 16)`` uint8.

    ``grouped``: group ``g`` covers rows ``[group_ends[g-1], group_ends[g])`` and
    starts at row ``dst_group_ends[g-1]`` (a multiple of 128) of the output; the
    tail program (``g == G``) zero-fills the row tiles after the last group.
    Else one group covers all ``R`` rows (``group_ends`` unused).
    """
    batches, rows, cols = scales.shape
    col_tiles = (cols + 3) // 4
    groups = group_ends.size(0) if grouped else 0
    out = torch.empty([batches, dst_row_tiles, col_tiles, 32, 16], dtype=torch.uint8, device=scales.device)
    for tile_b, tile_g, tile_ct in hl.tile([batches, groups + 1, col_tiles], block_size=[1, 1, None]):
        b = tile_b.begin
        g = tile_g.begin
        if grouped:
            is_tail = hl.full([], g, dtype=torch.int32) >= groups
            src_start = hl.load(group_ends, [g - 1], extra_mask=g > 0)
            src_end = torch.where(is_tail, src_start, hl.load(group_ends, [g], extra_mask=g < groups))
            dst_tile_start = hl.load(dst_group_ends, [g - 1], extra_mask=g > 0) // 128
            dst_tile_end = torch.where(
                is_tail, dst_row_tiles, (hl.load(dst_group_ends, [g], extra_mask=g < groups) + 127) // 128
            )
        else:
            src_start = hl.full([], 0, dtype=torch.int32)
            src_end = hl.full([], rows, dtype=torch.int32)
            dst_tile_start = hl.full([], 0, dtype=torch.int32)
            dst_tile_end = hl.full([], dst_row_tiles, dtype=torch.int32)
        # Within a tile, byte (i, 4 * j + c) holds row 32 * j + i, column c.
        i = hl.arange(32)[None, None, :, None]
        j = hl.arange(16)[None, None, None, :] // 4
        c = hl.arange(16)[None, None, None, :] % 4
        for tile_rt in hl.tile(dst_tile_start, dst_tile_end):
            src_row = src_start + (tile_rt.index[:, None, None, None] - dst_tile_start) * 128 + j * 32 + i
            src_col = tile_ct.index[None, :, None, None] * 4 + c
            valid = (src_row < src_end) & (src_col < cols)
            tile_bytes = hl.load(scales, [b, src_row, src_col], extra_mask=valid)
            out[b, tile_rt, tile_ct, :, :] = tile_bytes
    return out


@helion.kernel(static_shapes=False)
def mx_blocked_layout_k_groups_kernel(
    scales: torch.Tensor,
    group_ends: torch.Tensor,
    dst_group_ends: torch.Tensor,
    dst_cols: int,
) -> torch.Tensor:
    """Blocked layout of ``scales (R, C)`` (any strides) grouped along ``C``: ``ceil(R / 128) * 128 * dst_cols`` bytes.

    Group ``g`` covers columns ``[group_ends[g-1], group_ends[g])`` and owns the
    output columns ``[dst_group_ends[g-1], dst_group_ends[g])`` (multiples of 4),
    i.e. the bytes from ``dst_group_ends[g-1] * padded_rows``, tile ``(rt, ct)``
    at ``(rt * group_col_tiles + ct) * 512`` in them. The tail program
    (``g == G``) zero-fills the columns after the last group.
    """
    rows, cols = scales.shape
    row_tiles = (rows + 127) // 128
    groups = group_ends.size(0)
    out = torch.empty([row_tiles * 128 * dst_cols], dtype=torch.uint8, device=scales.device)
    for tile_g, tile_rt in hl.tile([groups + 1, row_tiles], block_size=[1, None]):
        g = tile_g.begin
        is_tail = hl.full([], g, dtype=torch.int32) >= groups
        src_start = hl.load(group_ends, [g - 1], extra_mask=g > 0)
        src_end = torch.where(is_tail, src_start, hl.load(group_ends, [g], extra_mask=g < groups))
        dst_start = hl.load(dst_group_ends, [g - 1], extra_mask=g > 0)
        dst_end = torch.where(is_tail, dst_cols, hl.load(dst_group_ends, [g], extra_mask=g < groups))
        col_tiles = (dst_end - dst_start) // 4
        group_base = dst_start * (row_tiles * 128)
        # Within a tile, byte (i, 4 * j + c) holds row 32 * j + i, column c.
        i = hl.arange(32)[None, None, :, None]
        lane = hl.arange(16)[None, None, None, :]
        rt = tile_rt.index[:, None, None, None]
        for tile_ct in hl.tile(0, col_tiles):
            ct = tile_ct.index[None, :, None, None]
            src_row = rt * 128 + (lane // 4) * 32 + i
            src_col = src_start + ct * 4 + lane % 4
            valid = (src_row < rows) & (src_col < src_end)
            tile_bytes = hl.load(scales, [src_row, src_col], extra_mask=valid)
            byte = group_base + (rt * col_tiles + ct) * 512 + i * 16 + lane
            in_group = (rt < row_tiles) & (ct < col_tiles)
            hl.store(out, [byte], tile_bytes, extra_mask=in_group)
    return out


SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.float8_e8m0fnu)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _blocked(
    scales: torch.Tensor,
    group_ends: torch.Tensor,
    dst_group_ends: torch.Tensor,
    dst_row_tiles: int,
    grouped: bool,
) -> torch.Tensor:
    """Run the kernel on ``scales (B, R, C)``: ``(B, dst_row_tiles * 128, ceil(C / 4) * 4)``, scales' dtype."""
    require_interpreter_on_cpu(scales)
    batches, rows, cols = scales.shape
    shape = (batches, dst_row_tiles * TILE_ROWS, _ceil_div(cols, TILE_COLS) * TILE_COLS)
    if scales.numel() == 0 or dst_row_tiles == 0:
        return torch.zeros(shape, dtype=scales.dtype, device=scales.device)
    config = select_config("mx_blocked_layout", {"R": rows, "C": cols}, DEFAULT_CONFIG)
    args = (scales.view(torch.uint8), group_ends, dst_group_ends, dst_row_tiles, grouped)
    out = launch(mx_blocked_layout_kernel, args, config)
    return out.view(shape).view(scales.dtype)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Blocked layout of a ``(rows, cols)`` e8m0 scale matrix (see the module docstring).

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, contiguous.

    Returns:
        ``(ceil(rows / 128) * 128, ceil(cols / 4) * 4)`` of ``scales``' dtype, bytes in blocked order.
    """
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES)
    return to_blocked_scales_per_expert(scales.unsqueeze(0))[0]


def to_blocked_scales_per_expert(scales: torch.Tensor) -> torch.Tensor:
    """Blocked layout of each expert's scales: ``(E, rows, cols)`` -> ``(E, padded_rows, padded_cols)``.

    Args:
        scales: ``(E, rows, cols)`` uint8 or float8_e8m0fnu, contiguous.

    Returns:
        ``(E, ceil(rows / 128) * 128, ceil(cols / 4) * 4)``; expert ``e``'s bytes are
        ``to_blocked_scales(scales[e])``'s.
    """
    check_tensor("scales", scales, ndim=3, dtypes=SCALE_DTYPES)
    unused = torch.empty(0, dtype=torch.int32, device=scales.device)
    return _blocked(scales, unused, unused, _ceil_div(scales.size(1), TILE_ROWS), grouped=False)


def to_blocked_scales_grouped(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of token-group scales, each group starting at a multiple of 128 rows.

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, contiguous (one row per token).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on scales' device.

    Returns:
        ``(blocked, group_starts)``: ``blocked`` ``(ceil(rows / 128) * 128 + G * 128,
        ceil(cols / 4) * 4)`` with group ``g``'s rows laid out as ``to_blocked_scales``
        of them from row ``group_starts[g]``; ``group_starts`` ``(G,)`` int32 (multiples
        of 128), computed on the device.
    """
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES)
    check_offsets(offs, scales.device)
    rows = scales.size(0)
    group_ends, padded_ends = aligned_group_ends(offs, rows, TILE_ROWS)
    group_starts = torch.nn.functional.pad(padded_ends[:-1], (1, 0))
    dst_row_tiles = _ceil_div(rows, TILE_ROWS) + offs.numel()
    blocked = _blocked(scales.unsqueeze(0), group_ends, padded_ends, dst_row_tiles, grouped=True)
    return blocked[0], group_starts


def to_blocked_scales_k_groups(scales: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked layout of scales whose column groups are laid out one after the other (wgrad operands).

    Args:
        scales: ``(rows, cols)`` uint8 or float8_e8m0fnu, any strides: for a wgrad
            operand, the ``.t()`` of ``quantize_mx_dim1_grouped``'s ``(blocks, C)``
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
    group_ends, padded_ends = aligned_group_ends(offs, cols, TILE_COLS)
    group_col_starts = torch.nn.functional.pad(padded_ends[:-1], (1, 0))
    padded_rows = _ceil_div(rows, TILE_ROWS) * TILE_ROWS
    dst_cols = _ceil_div(cols, TILE_COLS) * TILE_COLS + offs.numel() * TILE_COLS
    if padded_rows == 0:
        return torch.zeros((0, dst_cols), dtype=scales.dtype, device=scales.device), group_col_starts
    config = select_config("mx_blocked_layout_k_groups", {"R": rows, "C": cols}, K_GROUPS_DEFAULT_CONFIG)
    args = (scales.view(torch.uint8), group_ends, padded_ends, dst_cols)
    blocked = launch(mx_blocked_layout_k_groups_kernel, args, config)
    return blocked.view(padded_rows, dst_cols).view(scales.dtype), group_col_starts
