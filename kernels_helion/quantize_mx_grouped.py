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

Each program owns one cell and a strip of columns: it reads the cell once
(through the input's transposed view) and writes its dim0 rows. A cell inside
one group is then quantized in straight-line code; a cell at a group boundary
loops over its groups, writing each one's scales. Either way the cell's
transposed elements are stored once (every token of the cell is its own, so no
store is masked by group).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import abs_amax, magnitude_bits, magnitude_bits_to_amax
from kernels_helion.group_offsets import group_lanes, group_offsets
from kernels_helion.mx_format import (
    MX_BLOCK_SIZE,
    amax_to_e8m0,
    check_rounding,
    e8m0_inverse_scale,
    to_mx_element_bits,
)
from kernels_helion.token_groups import group_bounds, groups_meeting_rows
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_tensor

# block_sizes = [32-column blocks per program]; the token tile is one cell (32).
# Tuned configs: autotune_cache/sm90/quantize_mx_grouped.json and quantize_mx_dual_grouped.json.
DEFAULT_CONFIG = helion.Config(block_sizes=[4], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_mx_grouped_kernel(
    src_t: torch.Tensor,
    group_ends: torch.Tensor,
    block_offs: torch.Tensor,
    q_bits: torch.Tensor,
    q_scales: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    round_up: hl.constexpr,
    with_dim0: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> None:
    """Quantize ``src_t (NB, 32, M)`` (the ``(M, C)`` input as a strided view) into the given buffers.

    ``qt_bits (NB, 32, M)`` / ``qt_scales (rows, NB, 32)`` (zeroed) get the
    per-group 32x1 blocks; ``q_bits (M, NB, 32)`` / ``q_scales (M, NB)`` the
    1x32 blocks when ``with_dim0``. ``group_ends``: clamped, non-decreasing.
    """
    col_blocks, block, m = src_t.shape
    block = hl.specialize(block)
    # The input is read through its transposed view, so the token-contiguous output
    # is stored as it sits in registers: 1.2-1.4x faster on the H200 than reading
    # rows and permuting the tile for the store.
    for tile_nb, tile_t in hl.tile([col_blocks, m], block_size=[None, block]):
        # Loads past M read 0, which leaves every amax unchanged.
        v = src_t[tile_nb, :, tile_t].to(torch.float32)
        if with_dim0:
            exponent = amax_to_e8m0(abs_amax(v, dim=1), round_up)
            q_scales[tile_t, tile_nb] = exponent.permute(1, 0).to(torch.uint8)
            bits0 = to_mx_element_bits(v, e8m0_inverse_scale(exponent)[:, None, :])
            q_bits[tile_t, tile_nb, :] = bits0.permute(2, 0, 1)
        group_idx, ends, first_group, end_group = groups_meeting_rows(group_ends, tile_t, m, groups_pow2)
        first_start, first_end = group_bounds(group_idx, ends, first_group)
        if (first_start <= tile_t.begin) & (first_end >= tile_t.begin + block):
            # The whole cell is one group's (all cells but those at group boundaries): the
            # loop below without its masks, as straight-line code (10-15% faster on the H200).
            qt_bits[tile_nb, :, tile_t] = _quantize_group_cell(
                v, magnitude_bits(v), block_offs, qt_scales, tile_t, tile_nb, first_group, first_start, round_up
            )
        else:
            # Each group's tokens of the cell are merged into one tile, stored once;
            # tokens of no group (past the last end) stay 0.
            cell_bits = hl.zeros([tile_nb, block, tile_t], dtype=torch.uint8)
            for g in hl.grid(first_group, end_group):
                start, end = group_bounds(group_idx, ends, g)
                if end > start:
                    in_group = ((tile_t.index >= start) & (tile_t.index < end))[None, None, :]
                    group_bits = torch.where(in_group, magnitude_bits(v), 0)
                    bits = _quantize_group_cell(
                        v, group_bits, block_offs, qt_scales, tile_t, tile_nb, g, start, round_up
                    )
                    cell_bits = torch.where(in_group, bits, cell_bits)
            qt_bits[tile_nb, :, tile_t] = cell_bits


def _quantize_group_cell(
    v: torch.Tensor,
    group_bits: torch.Tensor,
    block_offs: torch.Tensor,
    qt_scales: torch.Tensor,
    tile_t: hl.Tile,
    tile_nb: hl.Tile,
    g: int,
    start: torch.Tensor,
    round_up: bool,
) -> torch.Tensor:
    """Device side: group ``g``'s 32x1 blocks of the cell ``v (NB, 32, 32)``: store their scales, return the bits.

    ``group_bits``: ``magnitude_bits(v)`` on the group's tokens, 0 elsewhere; ``start``:
    the group's first token. The caller keeps only the group's tokens of the bits.
    """
    exponent = amax_to_e8m0(magnitude_bits_to_amax(torch.amax(group_bits, dim=2)), round_up)
    scale_row = hl.load(block_offs, [g - 1], extra_mask=g > 0) + (
        tile_t.begin // MX_BLOCK_SIZE - start // MX_BLOCK_SIZE
    )
    hl.store(qt_scales, [scale_row, tile_nb, hl.arange(MX_BLOCK_SIZE)], exponent.to(torch.uint8))
    # unsqueeze, not [:, :, None]: in a helper, Helion 1.4 traces the latter as a slice it cannot lower.
    return to_mx_element_bits(v, e8m0_inverse_scale(exponent).unsqueeze(2))


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
    col_blocks = cols // MX_BLOCK_SIZE
    ends, block_offs = mx_token_blocks(offs, m)
    dim0_shape = (m, col_blocks) if with_dim0 else (0, 0)
    q_bits = torch.empty((*dim0_shape, MX_BLOCK_SIZE), dtype=torch.uint8, device=device)
    q_scales = torch.empty(dim0_shape, dtype=torch.uint8, device=device)
    qt_bits = torch.empty((cols, m), dtype=torch.uint8, device=device)
    # Rows of no block are never written and read 0.
    qt_scales = torch.zeros((scale_rows_bound(m, offs.numel()), cols), dtype=torch.uint8, device=device)
    if m > 0:
        # The dual mode stores twice the bytes per program: its own tuned configs.
        family = "quantize_mx_dual_grouped" if with_dim0 else "quantize_mx_grouped"
        config = select_config(family, {"M": m, "C": cols}, DEFAULT_CONFIG)
        args = (
            x.view(m, col_blocks, MX_BLOCK_SIZE).permute(1, 2, 0),
            ends,
            block_offs,
            q_bits,
            q_scales,
            qt_bits.view(col_blocks, MX_BLOCK_SIZE, m),
            qt_scales.view(-1, col_blocks, MX_BLOCK_SIZE),
            rounding == "rceil",
            with_dim0,
            group_lanes(offs.numel()),
        )
        launch(quantize_mx_grouped_kernel, args, config)
    e4m3 = torch.float8_e4m3fn
    return q_bits.view(e4m3).flatten(1), q_scales, qt_bits.view(e4m3), qt_scales, block_offs


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
