"""MXFP8 quantization of token groups along the tokens (32x1 blocks), for the MoE weight gradient.

wgrad contracts each group's tokens, so its operands are stored transposed
(tokens contiguous, ``(C, M)``) with e8m0 scales per 32 tokens of a column, and
no scale block may hold tokens of two groups.

How groups meet 32-token blocks: blocks are the tensor's aligned 32-token
*cells* (``[32 c, 32 c + 32)``) cut at group boundaries. Group ``g`` owns one
block per cell it touches (its first and last may be partial); a cell holding a
group boundary yields one block per group in it. So every block is one group's,
no input is padded or copied first (one pass; padding each group to 32 with
``pad_token_groups`` first would cost a full extra read and write), and the
GEMM reads whole aligned cells (masking the group's edge cells in registers).
When every group size is a multiple of 32 the blocks are exactly the groups'
own 32-token blocks, the layout Blackwell's native MXFP8 grouped GEMM takes.

Block map: group ``g``'s blocks are consecutive scale rows, from
``block_offs[g-1]`` (0 for ``g = 0``) to ``block_offs[g]`` (cumulative ends, as
``offs`` are for tokens), the one of cell ``c`` in row ``block_offs[g-1] + c -
start_g // 32``. There are at most ``ceil(M/32) + G - 1`` blocks, so the scales
have ``ceil(M/32) + G`` rows (a bound known without a host sync); rows past
``block_offs[-1]`` are 0. Scales are ``(rows, C)`` row-major: a GEMM step reads
one block's scales along ``N`` or ``K`` contiguously, and the quantizer writes
them so.

``quantize_mx_dual_grouped`` also writes the 1x32 (dim0, along ``C``)
quantization of the same input from the same read: the forward/dgrad operand and
the wgrad operand in one pass.

Group ``g`` spans ``[ends[g-1], ends[g])`` where ``ends`` is ``offs`` clamped
into ``[0, M]`` and made non-decreasing (running max), so bad offsets give
wrong groups, never out-of-bounds accesses. Tokens past ``offs[-1]`` belong to
no group: their transposed columns are 0 (their dim0 rows are quantized as usual).

Two kernels, launched one after the other:

- ``quantize_mx_grouped_kernel`` quantizes every cell as one block per column,
  with the scale of the group holding the cell's first token. Each program owns a
  tile of ``block_t`` tokens (whole cells) by a strip of columns; it reads the tile
  along the columns, the input's contiguous dimension, and stores it transposed, as
  a plain transposing copy does (91-97% of copy bandwidth on the H200; reading
  through the transposed view held this kernel to 72-80%). It stores the scales of
  the cells that lie inside one group, and every cell's elements unmasked (a mask
  by group breaks the 16-byte stores along the tokens).
- ``quantize_mx_boundary_cells_kernel`` then redoes the cells that hold a group
  boundary (at most one per group): scales and elements, group by group. This
  work in the first kernel, even behind a branch taken by few tiles, raised every
  program's registers from 94 to 241 and cost 15-20% of its speed on the H200.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from kernels_helion._launch import launch, require_interpreter_on_cpu, split_leading_block
from kernels_helion.fp8_format import abs_amax, magnitude_bits, magnitude_bits_to_amax
from kernels_helion.group_offsets import group_lanes, group_offsets
from kernels_helion.mx_format import (
    MX_BLOCK_SIZE,
    amax_to_e8m0,
    check_rounding,
    e8m0_inverse_scale,
    to_mx_element_bits,
)
from kernels_helion.token_groups import group_bounds, groups_at_rows, groups_meeting_rows
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_tensor

# block_sizes = [tokens (a multiple of 32), columns] per program.
# Tuned configs: autotune_cache/sm90/quantize_mx_grouped.json and quantize_mx_dual_grouped.json.
DEFAULT_CONFIG = helion.Config(block_sizes=[32, 128], num_warps=1, num_stages=1)
# block_sizes = [columns] of one boundary cell per program. Its programs are short and
# bound by load latency, so small ones, many resident per SM, run fastest: 64 columns
# on one warp was the best of 16 configs at each of 4 shapes on the H200
# (5.3-45 us against 7.3-85 us for 128 columns on 4 warps: benchmarks/results/mx_h200.md).
BOUNDARY_CONFIG = helion.Config(block_sizes=[64], num_warps=1, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_mx_grouped_kernel(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    block_offs: torch.Tensor,
    q_bits: torch.Tensor,
    q_scales: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    block_t: hl.constexpr,
    block: hl.constexpr,
    round_up: hl.constexpr,
    with_dim0: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> None:
    """Quantize ``x (M, C)`` into the given buffers, all but the cells holding a group boundary.

    ``qt_bits (C, M)`` / ``qt_scales (rows, C)`` (zeroed) get the per-group 32x1
    blocks (the boundary cells' elements are left to be overwritten); ``q_bits (M, C)``
    / ``q_scales (M, C // 32)`` the 1x32 blocks when ``with_dim0``. ``group_ends``:
    clamped, non-decreasing. ``block_t``: tokens per program, a multiple of
    ``block``, the MX block size (sizes of ``hl.arange`` and ``reshape`` must be
    compile-time constants, which a module constant is not in Helion).
    """
    m, cols = x.shape
    for tile_t, tile_c in hl.tile([m, cols], block_size=[block_t, None]):
        # The cells' groups, looked up before the tile is read: looked up after it, they took
        # the kernel to 152 registers a thread instead of 125 (64x128 on 2 warps, sm90 build).
        cell = tile_t.begin // block + hl.arange(tile_t.block_size // block)
        group, start, end = groups_at_rows(group_ends, cell * block, groups_pow2)
        # Loads past M read 0, which leaves every amax unchanged. The tile stays in the
        # input's dtype until the casts (an fp32 copy spilled at the 64-token tiles).
        v = x[tile_t, tile_c]
        if with_dim0:
            row_blocks = v.reshape(tile_t.block_size, tile_c.block_size // block, block)
            row_exponent = amax_to_e8m0(abs_amax(row_blocks, dim=2), round_up)
            col_block = tile_c.begin // block + hl.arange(tile_c.block_size // block)
            # A partial last column tile's blocks past the end are not stored (they would wrap into the next row).
            in_range = (col_block < cols // block)[None, :]
            hl.store(q_scales, [tile_t, col_block], row_exponent.to(torch.uint8), extra_mask=in_range)
            row_bits = to_mx_element_bits(row_blocks.to(torch.float32), e8m0_inverse_scale(row_exponent)[:, :, None])
            q_bits[tile_t, tile_c] = row_bits.reshape(tile_t.block_size, tile_c.block_size)
        cells = v.reshape(tile_t.block_size // block, block, tile_c.block_size)
        routed = group < group_ends.size(0)
        # Inside one group: the group runs to the cell's end (or to M's).
        inside = routed & (end >= torch.clamp(cell * block + block, max=m))
        scale_row = hl.load(block_offs, [group - 1], extra_mask=routed & (group > 0)) + (cell - start // block)
        exponent = amax_to_e8m0(abs_amax(cells, dim=1), round_up)
        hl.store(qt_scales, [scale_row, tile_c], exponent.to(torch.uint8), extra_mask=inside[:, None])
        elements = to_mx_element_bits(cells.to(torch.float32), e8m0_inverse_scale(exponent)[:, None, :])
        # Cells past the last group's end hold no group: 0.
        elements = torch.where(routed[:, None, None], elements, 0)
        qt_bits[tile_c, tile_t] = elements.reshape(tile_t.block_size, tile_c.block_size).T


@helion.kernel(static_shapes=False)
def quantize_mx_boundary_cells_kernel(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    block_offs: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    block: hl.constexpr,
    round_up: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> None:
    """Quantize the cells of ``x (M, C)`` that hold a group boundary into ``qt_bits`` / ``qt_scales``.

    Program ``p`` takes the cell holding group ``p``'s end when that end lies inside
    the cell (not on its first token, not at ``M``) and no earlier group's end does
    (so each such cell is done once). Each group's tokens of the cell are quantized
    with their own scales and merged into one tile, stored once; tokens of no group
    (past the last end) are stored as 0.
    """
    m, cols = x.shape
    for tile_p, tile_c in hl.tile([group_ends.size(0), cols], block_size=[1, None]):
        p = tile_p.begin
        boundary = hl.load(group_ends, [p])
        cell_begin = boundary // block * block
        earlier_inside = hl.load(group_ends, [p - 1], extra_mask=p > 0) > cell_begin
        if (boundary > cell_begin) & (boundary < m) & ~earlier_inside:
            rows = cell_begin + hl.arange(block)
            cell = hl.load(x, [rows, tile_c], extra_mask=(rows < m)[:, None])
            group_idx, ends, first_group, end_group = groups_meeting_rows(
                group_ends, cell_begin, cell_begin + block, m, groups_pow2
            )
            # Each group's first scale row, loaded with the ends rather than once a group in the loop.
            is_later_group = (group_idx > 0) & (group_idx < group_ends.size(0))
            first_rows = hl.load(block_offs, [group_idx - 1], extra_mask=is_later_group)
            elements = hl.zeros([block, tile_c], dtype=torch.uint8)
            for g in hl.grid(first_group, end_group):
                start, end = group_bounds(group_idx, ends, g)
                if end > start:
                    in_group = ((rows >= start) & (rows < end))[:, None]
                    group_bits = torch.where(in_group, magnitude_bits(cell), 0)
                    exponent = amax_to_e8m0(magnitude_bits_to_amax(torch.amax(group_bits, dim=0), cell.dtype), round_up)
                    first_row = torch.sum(torch.where(group_idx == g, first_rows, 0), dim=0)
                    scale_row = first_row + (cell_begin // block - start // block)
                    hl.store(qt_scales, [scale_row, tile_c], exponent.to(torch.uint8))
                    group_elements = to_mx_element_bits(cell.to(torch.float32), e8m0_inverse_scale(exponent)[None, :])
                    elements = torch.where(in_group, group_elements, elements)
            hl.store(qt_bits, [tile_c, rows], elements.T, extra_mask=(rows < m)[None, :])


def mx_token_blocks(offs: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ends, block_offs)``, both int32 ``(G,)`` on ``offs``' device, with no host sync.

    ``ends``: ``offs`` clamped into ``[0, num_tokens]``, running max. ``block_offs``:
    cumulative count of the 32-token cells each group touches (its scale blocks).
    """
    ends, block_offs, _ = group_offsets(offs, num_tokens, MX_BLOCK_SIZE, count_touched_units=True)
    return ends, block_offs


def scale_rows_bound(num_tokens: int, num_groups: int) -> int:
    """Rows of the per-group 32x1 scales: ``ceil(M / 32) + G``, a bound on the blocks."""
    return -(-num_tokens // MX_BLOCK_SIZE) + num_groups


def _quantize(
    x: torch.Tensor, offs: torch.Tensor, rounding: str, with_dim0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, allocate, launch: ``(q, q_scales, qt, qt_scales, block_offs)`` (``q*`` empty unless dim0)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_offsets(offs, x.device)
    check_rounding(rounding)
    m, cols = x.shape
    if cols == 0 or cols % MX_BLOCK_SIZE != 0:
        raise ValueError(
            f"x's columns (dim 1) must be a positive multiple of the MX block size {MX_BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    require_interpreter_on_cpu(x)
    device = x.device
    ends, block_offs = mx_token_blocks(offs, m)
    q_bits = torch.empty((m, cols) if with_dim0 else (0, 0), dtype=torch.uint8, device=device)
    q_scales = torch.empty((m, cols // MX_BLOCK_SIZE) if with_dim0 else (0, 0), dtype=torch.uint8, device=device)
    qt_bits = torch.empty((cols, m), dtype=torch.uint8, device=device)
    # Rows of no block are never written and read 0.
    qt_scales = torch.zeros((scale_rows_bound(m, offs.numel()), cols), dtype=torch.uint8, device=device)
    if m > 0:
        # The dual mode stores twice the bytes per program: its own tuned configs.
        family = "quantize_mx_dual_grouped" if with_dim0 else "quantize_mx_grouped"
        config = select_config(family, {"M": m, "C": cols}, DEFAULT_CONFIG)
        # The config names the token tile first; the kernel takes it as ``block_t``.
        block_t, kernel_config = split_leading_block(config)
        groups_pow2 = group_lanes(offs.numel())
        args = (
            x,
            ends,
            block_offs,
            q_bits,
            q_scales,
            qt_bits,
            qt_scales,
            block_t,
            MX_BLOCK_SIZE,
            rounding == "rceil",
            with_dim0,
            groups_pow2,
        )
        launch(quantize_mx_grouped_kernel, args, kernel_config)
        boundary_args = (x, ends, block_offs, qt_bits, qt_scales, MX_BLOCK_SIZE, rounding == "rceil", groups_pow2)
        launch(quantize_mx_boundary_cells_kernel, boundary_args, BOUNDARY_CONFIG)
    e4m3 = torch.float8_e4m3fn
    return q_bits.view(e4m3), q_scales, qt_bits.view(e4m3), qt_scales, block_offs


def quantize_mx_dim1_grouped(
    x: torch.Tensor, offs: torch.Tensor, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 of each token group of ``x`` with 32x1 blocks along the tokens, written transposed.

    Args:
        x: ``(M, C)`` bf16/fp16/fp32, contiguous (tokens along rows); ``C`` a multiple of 32.
            ``M`` is any size.
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        rounding: ``'rceil'`` or ``'floor'`` (see ``kernels_helion.mx_format``).

    Returns:
        ``(xt, scales, block_offs)``: ``xt`` ``(C, M)`` float8_e4m3fn, tokens contiguous
        (columns of tokens past ``offs[-1]`` are 0); ``scales`` ``(ceil(M/32) + G, C)``
        uint8 e8m0 exponents, one row per block (see the module docstring); ``block_offs``
        ``(G,)`` int32 cumulative block ends per group. For token ``t`` of group ``g``:
        ``x[t, c] ~= xt[c, t] * 2**(scales[block_offs[g-1] + t // 32 - start_g // 32, c] - 127)``.
    """
    _, _, xt, scales, block_offs = _quantize(x, offs, rounding, with_dim0=False)
    return xt, scales, block_offs


def quantize_mx_dual_grouped(
    x: torch.Tensor, offs: torch.Tensor, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_mx_dim0(x)`` and ``quantize_mx_dim1_grouped(x, offs)`` from one read of ``x``.

    Args:
        x, offs, rounding: as in ``quantize_mx_dim1_grouped``.

    Returns:
        ``(q (M, C), q_scales (M, C/32), xt (C, M), xt_scales (ceil(M/32) + G, C), block_offs (G,))``,
        each bitwise equal to what the two single functions return.
    """
    return _quantize(x, offs, rounding, with_dim0=True)
