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

``quantize_mx_rows_and_cols_grouped`` also writes the 1x32 (rows, along ``C``)
quantization of the same input from the same read: the forward/dgrad operand and
the wgrad operand in one pass.

Group ``g`` spans ``[ends[g-1], ends[g])`` where ``ends`` is ``offs`` clamped
into ``[0, M]`` and made non-decreasing (running max), so bad offsets give
wrong groups, never out-of-bounds accesses. Tokens past ``offs[-1]`` belong to
no group: their transposed columns are 0 (their rows are quantized as usual).

Two launches after ``mx_token_blocks`` (one small launch: the group ends, the
block map, and each cell's scale row or a mark saying it holds a group boundary
or lies past the last group). They write disjoint bytes, so they may run in
either order; they are separate launches because Helion cannot prove the
data-dependent scale rows of the two kinds of program disjoint (in one launch it
would order them by a grid-wide barrier). Their programs are:

- *cell* programs (``quantize_mx_grouped_kernel``): one 32-token cell by a strip
  of columns. A cell inside one group is one block per column: the program reads
  it along the columns, the input's contiguous dimension, and stores it
  transposed, as a plain transposing copy does (91-97% of copy bandwidth on the
  H200; reading through the transposed view held this quantizer to 72-80%). It
  skips the elements and scales of a cell that holds a group boundary: with one
  cell per program that is one mask per program, which keeps the 16-byte stores
  along the tokens (a mask by group broke them into byte stores).
- *boundary* programs (``quantize_mx_boundary_cells_kernel``): the cell holding
  one group's end (at most one such cell per group), group by group. This work
  inside the cell programs, even behind a branch few of them take, raised their
  registers from 94 to 241 and cost 15-20% of their speed on the H200.

The scale rows of no block are written as 0 by the same programs, so no buffer is
zeroed first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import magnitude_bits, magnitude_bits_to_amax
from kernels_helion.group_offsets import group_lanes, group_layout
from kernels_helion.mx_format import (
    MX_BLOCK_SIZE,
    amax_to_e8m0,
    check_rounding,
    e8m0_inverse_scale,
    to_mx_element_bits,
)
from kernels_helion.token_groups import group_bounds, groups_meeting_rows
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_tensor
from kernels_helion.device_mask import scalar_mask
from kernels_helion.tuning import is_amd, random_bf16, routed_offsets, vary

# block_sizes = [columns] of one 32-token cell per cell program.
# Tuned configs: autotune_cache/sm90/quantize_mx_cols_grouped.json and quantize_mx_rows_and_cols_grouped.json.
DEFAULT_CONFIG = helion.Config(block_sizes=[128], num_warps=1, num_stages=1)
# Columns of one boundary cell per program. The kernel's registers are the larger of
# its two loops': a 64-column boundary cell took them to 239 a thread, 16 columns to
# 105 (one warp, sm90 build), about the cell programs' own. 16 ran fastest
# (or within 2%) of 16 and 32 at five shapes on the H200 (docs/experiments.md).
BOUNDARY_BLOCK_C = 16
# ``mx_token_blocks``' marks for cells that are no group's whole block.
CELL_HOLDS_BOUNDARY = -1
CELL_PAST_GROUPS = -2
# ``mx_token_blocks``: one small program per group, writing its cells 256 at a time; nothing to tune.
TOKEN_BLOCKS_TILE_CELLS = 256
TOKEN_BLOCKS_CONFIG = helion.Config(num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_mx_boundary_cells_kernel(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    block_offs: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    block: hl.constexpr,
    boundary_block_c: hl.constexpr,
    round_up: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> None:
    """The 32x1 blocks of the cells that hold a group boundary, into ``qt_bits (C, M)`` / ``qt_scales (rows, C)``.

    One program takes one group ``p`` by a strip of columns. It quantizes the cell
    holding group ``p``'s end when that end lies inside the cell (not on its first
    token, not at ``M``) and no earlier group's end does (so each boundary cell is
    done once), group by group, and writes 0 to scale row ``ceil(M/32) + p`` when
    that is past the last block. ``group_ends``: clamped, non-decreasing;
    ``block_offs``: the groups' cumulative block ends (both from
    ``mx_token_blocks``). ``block``: the MX block size (sizes of ``hl.arange``
    must be compile-time constants, which a module constant is not in Helion).
    """
    m, cols = x.shape
    num_groups = group_ends.size(0)
    for tile_p, tile_col in hl.tile([num_groups, cols], block_size=[1, boundary_block_c]):
        total_blocks = hl.load(block_offs, [num_groups - 1])
        spare_row = (m + block - 1) // block + tile_p.index
        hl.store(
            qt_scales,
            [spare_row, tile_col],
            hl.zeros([tile_p, tile_col], dtype=torch.uint8),
            extra_mask=(spare_row >= total_blocks)[:, None],
        )
        p = tile_p.begin
        boundary = hl.load(group_ends, [p])
        boundary_begin = boundary // block * block
        rows = boundary_begin + hl.arange(block)
        earlier_inside = hl.load(group_ends, [p - 1], extra_mask=p > 0) > boundary_begin
        if (boundary > boundary_begin) & (boundary < m) & ~earlier_inside:
            cell = hl.load(x, [rows, tile_col], extra_mask=(rows < m)[:, None], eviction_policy="evict_last")
            lanes, lane_ends, first_group, end_group = groups_meeting_rows(
                group_ends, boundary_begin, boundary_begin + block, m, groups_pow2
            )
            # Each group's first scale row, loaded with the ends rather than once a group in the loop.
            is_later_group = (lanes > 0) & (lanes < num_groups)
            first_rows = hl.load(block_offs, [lanes - 1], extra_mask=is_later_group)
            cell_elements = hl.zeros([block, tile_col], dtype=torch.uint8)
            for g in hl.grid(first_group, end_group):
                group_start, group_end = group_bounds(lanes, lane_ends, g)
                if group_end > group_start:
                    in_group = ((rows >= group_start) & (rows < group_end))[:, None]
                    group_bits = torch.where(in_group, magnitude_bits(cell), 0)
                    group_exponent = amax_to_e8m0(magnitude_bits_to_amax(torch.amax(group_bits, dim=0), cell.dtype), round_up)
                    first_row = torch.sum(torch.where(lanes == g, first_rows, 0), dim=0)
                    group_row = first_row + (boundary_begin // block - group_start // block)
                    hl.store(qt_scales, [group_row, tile_col], group_exponent.to(torch.uint8))
                    group_elements = to_mx_element_bits(cell.to(torch.float32), e8m0_inverse_scale(group_exponent)[None, :])
                    cell_elements = torch.where(in_group, group_elements, cell_elements)
            hl.store(qt_bits, [tile_col, rows], cell_elements.T, extra_mask=(rows < m)[None, :])


@helion.kernel(static_shapes=False)
def quantize_mx_grouped_kernel(
    x: torch.Tensor,
    group_ends: torch.Tensor,
    block_offs: torch.Tensor,
    cell_rows: torch.Tensor,
    q_bits: torch.Tensor,
    q_scales: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    block: hl.constexpr,
    round_up: hl.constexpr,
    with_rows: hl.constexpr,
) -> None:
    """The 32x1 blocks of the cells inside one group, into ``qt_bits (C, M)`` / ``qt_scales (rows, C)``.

    ``q_bits (M, C)`` / ``q_scales (M, C // 32)`` get the 1x32 blocks of every row
    when ``with_rows``. One program takes one 32-token cell by a strip of columns.
    It quantizes a cell that lies inside one group (or past the last group's end:
    stored as 0), reading along the columns and storing transposed, and writes 0
    to scale row ``c`` of cell ``c`` when that is past the last block (no routed
    cell's row is: the blocks before it number at least ``c + 1``). A cell that
    holds a group boundary is left to ``quantize_mx_boundary_cells_kernel``.
    ``cell_rows``: each cell's scale row or mark (from ``mx_token_blocks``).
    """
    m, cols = x.shape
    num_groups = group_ends.size(0)
    for tile_t, tile_c in hl.tile([m, cols], block_size=[block, None]):
        cell_begin = tile_t.begin
        # One load, not a search among the group lanes: in two-warp programs (the rows-and-cols mode's) the
        # search's reductions crossed warps, and that mode ran 1-4% slower at the benchmark shapes,
        # 24% with 64 groups, on the H200 (docs/experiments.md).
        scale_row = hl.load(cell_rows, [cell_begin // block])
        inside = scalar_mask(scale_row >= 0)
        unrouted = scalar_mask(scale_row == CELL_PAST_GROUPS)
        past_blocks = scalar_mask(cell_begin // block >= hl.load(block_offs, [num_groups - 1]))
        # Loads past M read 0, which leaves every amax unchanged. Both amaxes reduce the same
        # fp32 magnitude bits, made once from the fp32 copy the scaling needs anyway, not two
        # of the 16-bit tile, each with its own mask and widening: 12-16% fewer instructions
        # executed by the rows-and-cols mode, 8% faster at 65536x7168 on the H200 (docs/experiments.md).
        # evict_last (both reads of x): grouped cols 1-3% faster on the H200, rows-and-cols unchanged;
        # evict_first 2-10% slower (docs/experiments.md).
        v = hl.load(x, [tile_t, tile_c], eviction_policy="evict_last").to(torch.float32)
        magnitudes = magnitude_bits(v)
        if with_rows:
            row_blocks = v.reshape(tile_t.block_size, tile_c.block_size // block, block)
            row_magnitudes = magnitudes.reshape(tile_t.block_size, tile_c.block_size // block, block)
            row_exponent = amax_to_e8m0(magnitude_bits_to_amax(torch.amax(row_magnitudes, dim=2)), round_up)
            col_block = tile_c.begin // block + hl.arange(tile_c.block_size // block)
            # A partial last column tile's blocks past the end are not stored (they would wrap into the next row).
            in_range = (col_block < cols // block)[None, :]
            hl.store(q_scales, [tile_t, col_block], row_exponent.to(torch.uint8), extra_mask=in_range)
            row_bits = to_mx_element_bits(row_blocks, e8m0_inverse_scale(row_exponent)[:, :, None])
            q_bits[tile_t, tile_c] = row_bits.reshape(tile_t.block_size, tile_c.block_size)
        exponent = amax_to_e8m0(magnitude_bits_to_amax(torch.amax(magnitudes, dim=0)), round_up)
        hl.store(
            qt_scales,
            [torch.where(inside, scale_row, cell_begin // block), tile_c],
            torch.where(inside, exponent, 0).to(torch.uint8),
            extra_mask=inside | past_blocks,
        )
        elements = to_mx_element_bits(v, e8m0_inverse_scale(exponent)[None, :])
        hl.store(qt_bits, [tile_c, tile_t], elements.T, extra_mask=inside)
        # Cells past the last group's end hold no group: 0, by a store of its own (a select
        # of the elements cost an instruction an element). Scalar masks (one cell per
        # program) keep the 16-byte stores along the tokens.
        hl.store(qt_bits, [tile_c, tile_t], hl.zeros([tile_c, tile_t], dtype=torch.uint8), extra_mask=unrouted)


@helion.kernel(static_shapes=False)
def mx_token_blocks_kernel(
    offs: torch.Tensor,
    ends: torch.Tensor,
    block_offs: torch.Tensor,
    cell_rows: torch.Tensor,
    num_tokens: int,
    block: hl.constexpr,
    groups_pow2: hl.constexpr,
    block_cells: hl.constexpr,
) -> None:
    """Write ``ends``, ``block_offs`` (program 0) and ``cell_rows`` (see ``mx_token_blocks``).

    One program per group ``g`` writes the cells it covers whole (its rows) and, when
    its end lies inside a cell (not on its first token, not at ``M``), that cell's
    mark; program ``G`` marks the cells past the last group's end. So every cell is
    written, by ranges, with no per-cell search among the groups (which, as a
    ``(cells, G)`` comparison, made this launch 2-7x slower on the H200). Only
    int32 maxima pick lane values: Helion sums integers in int64.
    """
    num_groups = offs.size(0)
    cells = cell_rows.size(0)
    for tile_g in hl.tile(num_groups + 1, block_size=1):
        g = tile_g.begin
        lanes, is_group, group_ends, block_ends, _ = group_layout(offs, num_tokens, block, groups_pow2, True)
        if g == 0:
            hl.store(ends, [lanes], group_ends, extra_mask=is_group)
            hl.store(block_offs, [lanes], block_ends, extra_mask=is_group)
        # Group g's tokens [start, end), and its first scale row (block_ends' lane g - 1).
        start, end = group_bounds(lanes, group_ends, g)
        first_row, _ = group_bounds(lanes, block_ends, g)
        routed = torch.amax((is_group & (lanes == g)).to(torch.int32), dim=0) > 0  # g < G, as a device value
        # Cells whole inside the group; with M the group's end, M's partial last cell too.
        first_cell = torch.where(routed, (start + block - 1) // block, (torch.amax(group_ends, dim=0) + block - 1) // block)
        end_cell = torch.where(routed, torch.where(end == num_tokens, (end + block - 1) // block, end // block), cells)
        for tile_c in hl.tile(first_cell, torch.maximum(end_cell, first_cell), block_size=block_cells):
            rows = torch.where(routed, first_row + (tile_c.index - start // block), CELL_PAST_GROUPS)
            hl.store(cell_rows, [tile_c], rows)
        holds_end = routed & (end > start) & (end % block != 0) & (end < num_tokens)
        hl.store(cell_rows, [end // block], CELL_HOLDS_BOUNDARY, extra_mask=holds_end)


def mx_token_blocks(offs: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, block_offs, cell_rows)``, int32 on ``offs``' device, from one launch, with no host sync.

    ``ends (G,)``: ``offs`` clamped into ``[0, num_tokens]``, running max.
    ``block_offs (G,)``: cumulative count of the 32-token cells each group touches
    (its scale blocks). ``cell_rows (ceil(num_tokens / 32),)``: for each cell inside
    one group, the scale row of its block; ``CELL_HOLDS_BOUNDARY`` for a cell holding
    a group's end (not on its first token), ``CELL_PAST_GROUPS`` for one past the
    last group's end.
    """
    require_interpreter_on_cpu(offs)
    num_groups = offs.numel()
    device = offs.device
    cells = -(-num_tokens // MX_BLOCK_SIZE)
    cell_rows = torch.empty(cells, dtype=torch.int32, device=device)
    if cells == 0:
        # No tokens: every group is empty, ends at 0 and has no blocks.
        return torch.zeros(num_groups, dtype=torch.int32, device=device), torch.zeros_like(offs), cell_rows
    ends = torch.empty(num_groups, dtype=torch.int32, device=device)
    block_offs = torch.empty(num_groups, dtype=torch.int32, device=device)
    args = (offs, ends, block_offs, cell_rows, num_tokens, MX_BLOCK_SIZE, group_lanes(num_groups), TOKEN_BLOCKS_TILE_CELLS)
    launch(mx_token_blocks_kernel, args, TOKEN_BLOCKS_CONFIG)
    return ends, block_offs, cell_rows


@functools.cache
def _boundary_config(num_warps: int, num_stages: int) -> helion.Config:
    """The boundary programs' config: their tile is fixed; they take the tuned config's warps and stages.

    One object per pair, as ``launch``'s fast path is keyed on the config's identity.
    """
    return helion.Config(num_warps=num_warps, num_stages=num_stages)


def scale_rows_bound(num_tokens: int, num_groups: int) -> int:
    """Rows of the per-group 32x1 scales: ``ceil(M / 32) + G``, a bound on the blocks."""
    return -(-num_tokens // MX_BLOCK_SIZE) + num_groups


def _quantize(
    x: torch.Tensor, offs: torch.Tensor, rounding: str, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, allocate, launch: ``(q, q_scales, qt, qt_scales, block_offs)`` (``q*`` empty unless ``with_rows``)."""
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
    # The rows-and-cols mode stores twice the bytes per program: its own tuned configs.
    family = "quantize_mx_rows_and_cols_grouped" if with_rows else "quantize_mx_cols_grouped"
    config = select_config(family, {"M": m, "C": cols}, DEFAULT_CONFIG)
    pid_type = config.config.get("pid_type", "flat")
    if pid_type != "flat":
        # Helion's other program-id layouts ("xyz", both persistent types) make this kernel of
        # two loops access memory out of bounds on the H200.
        raise ValueError(f"{family} configs must use pid_type 'flat', got {pid_type!r}")
    device = x.device
    ends, block_offs, cell_rows = mx_token_blocks(offs, m)
    q_bits = torch.empty((m, cols) if with_rows else (0, 0), dtype=torch.uint8, device=device)
    q_scales = torch.empty((m, cols // MX_BLOCK_SIZE) if with_rows else (0, 0), dtype=torch.uint8, device=device)
    qt_bits = torch.empty((cols, m), dtype=torch.uint8, device=device)
    qt_scales = torch.empty((scale_rows_bound(m, offs.numel()), cols), dtype=torch.uint8, device=device)
    if m == 0:
        qt_scales.zero_()  # no tokens: no blocks
    else:
        round_up = rounding == "rceil"
        boundary_args = (
            x, ends, block_offs, qt_bits, qt_scales, MX_BLOCK_SIZE, BOUNDARY_BLOCK_C, round_up, group_lanes(offs.numel())
        )
        boundary_config = _boundary_config(config.num_warps, config.num_stages)
        launch(quantize_mx_boundary_cells_kernel, boundary_args, boundary_config)
        cell_args = (x, ends, block_offs, cell_rows, q_bits, q_scales, qt_bits, qt_scales, MX_BLOCK_SIZE, round_up, with_rows)
        launch(quantize_mx_grouped_kernel, cell_args, config)
    e4m3 = torch.float8_e4m3fn
    return q_bits.view(e4m3), q_scales, qt_bits.view(e4m3), qt_scales, block_offs


def quantize_mx_cols_grouped(
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
    _, _, xt, scales, block_offs = _quantize(x, offs, rounding, with_rows=False)
    return xt, scales, block_offs


def quantize_mx_rows_and_cols_grouped(
    x: torch.Tensor, offs: torch.Tensor, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_mx_rows(x)`` and ``quantize_mx_cols_grouped(x, offs)`` from one read of ``x``.

    Args:
        x, offs, rounding: as in ``quantize_mx_cols_grouped``.

    Returns:
        ``(q (M, C), q_scales (M, C/32), xt (C, M), xt_scales (ceil(M/32) + G, C), block_offs (G,))``,
        each bitwise equal to what the two single functions return.
    """
    return _quantize(x, offs, rounding, with_rows=True)


# Tuning: ``quantize_mx_grouped_kernel`` per family: 32x1 blocks only, or with the 1x32 (rows) copy too.
def _register_tuning(name: str, quantize: Callable[..., object]) -> None:
    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = random_bf16(shape["M"], shape["C"], device=device)
        offs = routed_offsets(shape["M"] - 7 * 16, 16, device)
        return lambda: quantize(x, offs)

    def space(arch: str) -> list[helion.Config]:
        # [columns] of one 32-token cell per program. Few warps: on the H200, 1-2 warps won
        # at every shape and 4-8 warps ran 1.3-1.9x slower (transposed stores). Program
        # order of the cell loop: cells fastest, or column strips fastest (the rows-and-cols family's best
        # on the H200: 65536x7168 G=32 at 626 us against 750 us).
        columns = [[64], [128], [256], [32]]
        orders = [[[0, 1]], [[1, 0]]]
        warps = [1, 2, 4] if not is_amd(arch) else [1, 2]
        return vary(DEFAULT_CONFIG, block_sizes=columns, num_warps=warps, loop_orders=orders)

    shapes = [{"M": 32768, "C": c} for c in (2048, 5120, 7168)] + [{"M": 65536, "C": 7168}]
    register_tuning(name, DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "C": 64})


_register_tuning("quantize_mx_cols_grouped", quantize_mx_cols_grouped)
_register_tuning("quantize_mx_rows_and_cols_grouped", quantize_mx_rows_and_cols_grouped)
