"""Blockwise FP8 quantization (DeepSeek-V3's recipe): one scale per 1x128, 128x1 or 128x128 block.

- Activations and gradients, as the left GEMM operand (``x @ W.T``, contraction
  over ``K``): one scale per 1x128 block of a row (``quantize_blockwise_rows``).
- The same tensor as a wgrad operand (contraction over tokens): stored
  transposed, tokens contiguous, one scale per 128x1 block of a column
  (``quantize_blockwise_cols``; per token group for MoE:
  ``quantize_blockwise_cols_grouped``). ``..._rows_and_cols[_grouped]`` give both.
- Weights: one scale per 128x128 block, stored as is and/or transposed (the
  block's scale is the same for ``W`` and ``W.T``).

One kernel does all of them. It sees its input as ``(B, R, C)`` and gives each
program one ``block x block`` tile: a read of the tile yields its row amaxes
(1 x block scales) or its column amaxes (block x 1 scales), or its tile amax
(block x block scale), which serves both weight layouts, so
``quantize_blockwise_weights_both_layouts`` reads ``W`` once. The activation
``..._rows_and_cols`` variants launch it twice (1x128, then
128x1): on the H200 that is 1.1-1.3x faster than one launch writing both
layouts from one read, which keeps the tile in two register layouts
(``docs/experiments.md``). In grouped mode, row blocks
start at each token group's start, so no 128-token block straddles two
groups, and the transposed output is in block space: block ``p`` fills columns
``[p*128, (p+1)*128)``, zero-padded, so that the wgrad GEMM loads whole
aligned blocks. The block map is each group's end and block-aligned slots,
from one ``group_offsets`` launch; a program finds its block's group by a
reduction over the groups (building a per-block table with eager PyTorch took
~10 tiny kernels a call).

Scale layouts (all float32 dequantization scales, see ``fp8_format``):

- 1x128 (``quantize_blockwise_rows``): logical shape ``(M, ceil(K/128))``
  indexed ``scales[m, kb]``, stored K-block-major: the tensor is a transposed
  view of a contiguous ``(ceil(K/128), round_up(M, 4))`` buffer (strides
  ``(1, round_up(M, 4))``), DeepGEMM's "TMA-aligned column-major" layout. A GEMM
  tile of BM rows reads, per K step, BM contiguous scales (one TMA box or one
  coalesced load) instead of BM scattered ones; the quantizer's stores are
  contiguous too. ``scales.t()`` is the contiguous ``(ceil(K/128), M)`` view.
- 128x1 (``..._cols``): ``(ceil(M/128), K)`` row-major: a wgrad tile reads
  contiguous scales along K per token block.
- 128x128: ``(ceil(N/128), ceil(K/128))`` row-major, ``(E, ...)`` for experts;
  the transposed weight ``(K, N)`` gets the transposed scales
  ``(ceil(K/128), ceil(N/128))``, also contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.fp8_format import (
    BLOCKWISE_SCALE_BLOCK,
    abs_amax,
    amax_to_scale,
    check_fp8_dtype,
    fp8_max,
    is_fnuz,
    magnitude_bits,
    magnitude_bits_to_amax,
    scale_reciprocal,
    to_fp8_bits,
)
from kernels_helion.group_offsets import group_lanes, group_offsets
from kernels_helion.transpose_fp8 import transpose_fp8
from kernels_helion.transposed_store import reload_stored_scales
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_tensor
from kernels_helion.device_mask import scalar_mask
from kernels_helion.tuning import is_amd, random_bf16, routed_offsets, vary, warps_for

# Every tile is one scaling block, so there is no block size to tune. Tuned per family of variants
# (``CONFIG_FAMILIES``): their registers per tile differ about twofold (one layout or two, a transpose).
DEFAULT_CONFIG = helion.Config(block_sizes=[], num_warps=8, num_stages=1)

# Cache keys the launchers pass to ``select_config``, by family: 1x128; 128x1 (transposed); the
# same per token group; 128x128 weights (either layout or both).
CONFIG_FAMILIES: tuple[str, ...] = (
    "quantize_blockwise_rows",
    "quantize_blockwise_cols",
    "quantize_blockwise_cols_grouped",
    "quantize_blockwise_weights",
)

BLOCK_SIZES: tuple[int, ...] = (32, 64, 128)

# The 1x128 scale buffer pads its token dimension to a multiple of 4 floats: TMA needs 16-byte strides.
SCALE_ROW_ALIGN = 4


def _cast(v, scale, max_fp8, fnuz):  # noqa: ANN001, ANN202
    """Device helper: fp8 bits of ``v`` scaled by ``1 / scale`` (``scale`` broadcasts against ``v``)."""
    return to_fp8_bits(v * scale_reciprocal(scale), max_fp8, fnuz)


def _row_block_segment(
    group_ends: torch.Tensor, layout_ends: torch.Tensor, slot: int, rows: int, groups_pow2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device helper: ``(in_group, shift, end)`` of the grouped row block whose slot starts at column ``slot``.

    Segment ``s < G`` is group ``s``: rows ``[group_ends[s-1], group_ends[s])``
    in slots ``[layout_ends[s-1], layout_ends[s])`` (from 0 for ``s = 0``);
    segment ``G`` is the tail: rows ``[group_ends[G-1], rows)`` from slot
    ``layout_ends[G-1]``. The block's segment is the number of groups whose
    slots end by ``slot``, a sum over ``G`` lanes (``in_group``: ``s < G``).
    Slot column ``c`` holds row ``c + shift``, one of the segment's if ``< end``.
    """
    groups = group_ends.size(0)
    g = hl.arange(groups_pow2)
    is_group = g < groups
    ends = hl.load(group_ends, [g], extra_mask=is_group)
    slot_ends = hl.load(layout_ends, [g], extra_mask=is_group)
    seg = torch.sum((is_group & (slot_ends <= slot)).to(torch.int32), dim=0)
    before = g < seg
    # Every group's padding adds to the shift, so group s - 1 has the smallest (0 before group 0).
    shift = torch.amin(torch.where(before, ends - slot_ends, 0), dim=0)
    end = torch.amin(torch.where(is_group & ~before, ends, rows), dim=0)
    return scalar_mask(seg < groups), shift, end


@helion.kernel(static_shapes=False)
def quantize_blockwise_kernel(
    src: torch.Tensor,
    q_bits: torch.Tensor,
    q_scales: torch.Tensor,
    qt_bits: torch.Tensor,
    qt_scales: torch.Tensor,
    group_ends: torch.Tensor,
    layout_ends: torch.Tensor,
    row_blocks: int,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    block: hl.constexpr,
    square: hl.constexpr,
    store_q: hl.constexpr,
    store_qt: hl.constexpr,
    grouped: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> None:
    """Quantize ``src (B, R, C)`` by ``block x block`` tiles into the given buffers.

    ``square``: one scale per tile, ``q_scales (B, nRB, nCB)`` and ``qt_scales
    (B, nCB, nRB)``. Else ``q`` gets 1 x block scales ``q_scales (B, nCB,
    R_pad)`` (K-block-major) and ``qt`` block x 1 scales ``qt_scales (B, nRB,
    C)``, one of the two per launch. ``q_bits (B, R, C)`` / ``qt_bits (B, C,
    R)`` are written when ``store_q`` / ``store_qt`` (both only if ``square``);
    there are ``row_blocks`` (``nRB``) row blocks.
    Grouped (non-square, ``store_qt``): ``group_ends`` / ``layout_ends`` are
    ``group_offsets(offs, R, block)``'s ``ends`` / ``layout_ends`` (``G``
    groups, ``groups_pow2`` lanes: ``G`` rounded up to a power of 2; 1 if not
    grouped). Group ``g`` owns row blocks ``[layout_ends[g-1], layout_ends[g])
    / block``, the tail past the last group the next ``ceil((R -
    group_ends[G-1]) / block)`` (no ``qt`` scales); later blocks are unused.
    ``qt_bits`` is then ``(B, C, nRB * block)`` in block space: the ``i``-th
    token of block ``p`` goes to column ``p * block + i``, and every column of
    no group's token is 0.
    """
    batches, rows, cols = src.shape
    # Each program reads its tile once, straight-line: a single-iteration inner loop over the
    # tile's rows kept far more registers live (sm90, 8 warps, both layouts: 255 -> 145 a thread).
    for tile_b, tile_p, tile_c in hl.tile([batches, row_blocks, cols], block_size=[1, 1, block]):
        b = tile_b.begin
        p = tile_p.begin
        lanes = hl.arange(block)
        if grouped:
            in_group, shift, end = _row_block_segment(group_ends, layout_ends, p * block, rows, groups_pow2)
            tokens = p * block + lanes + shift
            # An unused block (past the tail's blocks) starts at or past ``rows``: it has no token.
            in_block = tokens < end
        else:
            tokens = p * block + lanes
            in_block = tokens < rows
        # Rows and columns outside the block load as 0, which leaves every amax unchanged.
        v = hl.load(src, [b, tokens, tile_c], extra_mask=in_block[:, None]).to(torch.float32)
        if square:
            tile_amax = magnitude_bits_to_amax(torch.amax(torch.amax(magnitude_bits(v), dim=1), dim=0))
            scale = amax_to_scale(tile_amax, max_fp8, round_scales_to_power_of_2)
            bits = _cast(v, scale, max_fp8, fnuz)
            if store_q:
                q_scales[b, p, tile_c.id] = scale
                hl.store(q_bits, [b, tokens, tile_c], bits, extra_mask=in_block[:, None])
            if store_qt:
                qt_scales[b, tile_c.id, p] = scale
                hl.store(qt_bits, [b, tile_c, tokens], bits.permute(1, 0), extra_mask=in_block[None, :])
        elif store_q:
            row_scale = amax_to_scale(abs_amax(v, dim=1), max_fp8, round_scales_to_power_of_2)
            hl.store(q_scales, [b, tile_c.id, tokens], row_scale, extra_mask=in_block)
            row_bits = _cast(v, row_scale.unsqueeze(1), max_fp8, fnuz)
            hl.store(q_bits, [b, tokens, tile_c], row_bits, extra_mask=in_block[:, None])
        else:
            col_scale = amax_to_scale(abs_amax(v, dim=0), max_fp8, round_scales_to_power_of_2)
            # The cast takes the scales as read back from memory, so that Triton transposes the tile
            # as bf16 with ldmatrix (``transposed_store``): 1.4-1.8x faster on the H200.
            if grouped:
                hl.store(qt_scales, [b, p, tile_c], col_scale, extra_mask=in_group)
                col_scale = reload_stored_scales(qt_scales, [b, p, tile_c], in_group)
            else:
                qt_scales[b, p, tile_c] = col_scale
                col_scale = reload_stored_scales(qt_scales, [b, p, tile_c])
            col_bits = _cast(v, col_scale.unsqueeze(0), max_fp8, fnuz)
            if grouped:
                # Block space: the block's qt columns are its whole, aligned slot [p*block, (p+1)*block),
                # written in full (zero past the block's last token, in the tail and in unused slots).
                slot_bits = torch.where(in_group, col_bits, 0).permute(1, 0)
                hl.store(qt_bits, [b, tile_c, p * block + lanes], slot_bits)
            else:
                hl.store(qt_bits, [b, tile_c, tokens], col_bits.permute(1, 0), extra_mask=in_block[None, :])


def _quantize_blocks(
    src: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    block: int,
    *,
    square: bool,
    store_q: bool,
    store_qt: bool,
    offs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate, launch ``quantize_blockwise_kernel`` on ``src (B, R, C)``, view bits as fp8.

    Returns ``(q (B, R, C), q_scales, qt (B, C, R), qt_scales, group_block_starts)``
    in the kernel's buffer layouts (unrequested outputs are empty; grouped: ``qt``
    is ``(B, C, nRB * block)`` in block space, ``group_block_starts (G,)`` int32
    is each group's first row block; else it is empty).
    """
    require_interpreter_on_cpu(src)
    assert square or not (store_q and store_qt), "1 x block and block x 1 scales take one launch each"
    batches, rows, cols = src.shape
    device = src.device
    col_blocks = -(-cols // block)
    row_blocks = -(-rows // block)
    if offs is None:
        # Read by the grouped path only.
        group_ends = layout_ends = group_block_starts = torch.empty((0,), dtype=torch.int32, device=device)
    else:
        # The block map: groups' clamped ends and block-aligned slots, in one launch.
        group_ends, layout_ends, layout_starts = group_offsets(offs, rows, block)
        group_block_starts = layout_starts // block
        # G groups and the tail own sum(ceil(size / block)) < rows / block + G + 1 blocks.
        row_blocks += offs.numel()

    def buffer(shape: tuple[int, ...], wanted: bool, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape if wanted else (0, 0, 0), dtype=dtype, device=device)

    q_bits = buffer((batches, rows, cols), store_q, torch.uint8)
    qt_bits = buffer((batches, cols, rows if offs is None else row_blocks * block), store_qt, torch.uint8)
    if square:
        q_scales = buffer((batches, row_blocks, col_blocks), store_q, torch.float32)
        qt_scales = buffer((batches, col_blocks, row_blocks), store_qt, torch.float32)
    else:
        padded_rows = -(-rows // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN
        q_scales = buffer((batches, col_blocks, padded_rows), store_q, torch.float32)
        # Grouped: scale rows of no group (tail, unused) are never written and read 0.
        qt_scales = (torch.zeros if offs is not None else torch.empty)(
            (batches, row_blocks, cols) if store_qt else (0, 0, 0), dtype=torch.float32, device=device
        )
    if square:
        family = "weights"
    elif store_q:
        family = "rows"
    else:
        family = "cols" if offs is None else "cols_grouped"
    config = select_config(f"quantize_blockwise_{family}", {"R": rows, "C": cols}, DEFAULT_CONFIG)
    args = (
        src,
        q_bits,
        q_scales,
        qt_bits,
        qt_scales,
        group_ends,
        layout_ends,
        row_blocks,
        fp8_max(float8_dtype),
        is_fnuz(float8_dtype),
        round_scales_to_power_of_2,
        block,
        square,
        store_q,
        store_qt,
        offs is not None,
        1 if offs is None else group_lanes(offs.numel()),
    )
    launch(quantize_blockwise_kernel, args, config)
    return q_bits.view(float8_dtype), q_scales, qt_bits.view(float8_dtype), qt_scales, group_block_starts


def _check_act(x: object, float8_dtype: torch.dtype, block: int) -> torch.Tensor:
    x = check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_fp8_dtype(float8_dtype)
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block}")
    if x.size(1) == 0:
        raise ValueError(f"x must have at least one column (K >= 1), got shape {tuple(x.shape)}")
    return x


def _act_scales_view(q_scales: torch.Tensor, rows: int) -> torch.Tensor:
    """``(M, ceil(K/block))`` logical view of the K-block-major buffer ``(1, nKB, M_pad)``."""
    return q_scales[0, :, :rows].t()


def quantize_blockwise_rows(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 1 x ``block`` block of each row (GEMM left operand).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        block: block length along K, one of ``BLOCK_SIZES`` (DeepSeek-V3: 128).

    Returns:
        ``(x_fp8, scales)``: ``x_fp8`` is ``(M, K)`` row-major; ``scales`` is
        ``(M, ceil(K/block))`` float32, K-block-major in memory (strides ``(1,
        round_up(M, 4))``, see the module docstring; the padding is unspecified), with
        ``x[m, k] ~= x_fp8[m, k] * scales[m, k // block]``.
    """
    _check_act(x, float8_dtype, block)
    m, k = x.shape
    q, q_scales, _, _, _ = _quantize_blocks(
        x.unsqueeze(0), float8_dtype, round_scales_to_power_of_2, block,
        square=False, store_q=True, store_qt=False,
    )
    return q[0], _act_scales_view(q_scales, m)


def quantize_blockwise_cols(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per ``block`` x 1 block of each column, written transposed.

    For wgrad (contraction over tokens). Args as ``quantize_blockwise_rows``.

    Returns:
        ``(xt_fp8, scales)``: ``xt_fp8`` is ``(K, M)`` contiguous (tokens
        contiguous); ``scales`` is ``(ceil(M/block), K)`` float32 row-major, with
        ``x[m, k] ~= xt_fp8[k, m] * scales[m // block, k]``.
    """
    _check_act(x, float8_dtype, block)
    _, _, qt, qt_scales, _ = _quantize_blocks(
        x.unsqueeze(0), float8_dtype, round_scales_to_power_of_2, block,
        square=False, store_q=False, store_qt=True,
    )
    return qt[0], qt_scales[0]


def quantize_blockwise_rows_and_cols(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blockwise_rows`` and ``quantize_blockwise_cols`` of ``x``, in one call.

    Two launches, each reading ``x``: faster than one read into both layouts
    (see the module docstring).

    Returns:
        ``(x_fp8 (M, K), scales (M, ceil(K/block)), xt_fp8 (K, M), scales_t
        (ceil(M/block), K))``, the two functions' results.
    """
    # Each call checks x before it launches; the first one raises for bad input.
    quant = (float8_dtype, round_scales_to_power_of_2, block)
    return (*quantize_blockwise_rows(x, *quant), *quantize_blockwise_cols(x, *quant))


def quantize_blockwise_cols_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blockwise_cols`` per token group: no block crosses a group boundary.

    Each group's ``block``-token blocks start at the group's first token (the
    last one is partial unless the size is a multiple of ``block``). The
    transposed output is in block space (DeepGEMM's M-aligned layout): each
    block owns a whole, aligned ``block``-column slot, so a wgrad GEMM reads
    every block as a full aligned tile, with no mask (its padding is 0).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous (tokens sorted by group).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        float8_dtype, round_scales_to_power_of_2, block: as in ``quantize_blockwise_rows``.

    Returns:
        ``(xt_fp8, scales, group_block_starts)``: ``scales`` is ``(R, K)``
        float32 with ``R = ceil(M/block) + G`` (an upper bound on the number of
        blocks, known without a sync); ``xt_fp8`` is ``(K, R * block)``
        contiguous; ``group_block_starts`` is ``(G,)`` int32, computed on the
        device. Block ``j`` of group ``g`` (tokens ``start_g + j*block ...``,
        ``j < ceil(size_g/block)``) is block row ``r = group_block_starts[g] + j``:
        its scales are row ``r`` and its tokens columns ``r * block ...`` of
        ``xt_fp8``, so for token ``t`` of group ``g`` with ``i = t - start_g``:
        ``x[t, k] ~= xt_fp8[k, c] * scales[r, k]``, ``r = group_block_starts[g] + i // block``,
        ``c = r * block + i % block``. Rows of no group's block and columns of
        no group's token (a block's columns past the group's end, unused
        blocks, tokens past ``offs[-1]``) hold 0. Group ends are clamped into
        ``[0, M]`` and made non-decreasing (running max, ``group_offsets``).
    """
    _check_act(x, float8_dtype, block)
    check_offsets(offs, x.device)
    _, _, qt, qt_scales, group_block_starts = _quantize_blocks(
        x.unsqueeze(0), float8_dtype, round_scales_to_power_of_2, block,
        square=False, store_q=False, store_qt=True, offs=offs,
    )
    return qt[0], qt_scales[0], group_block_starts


def quantize_blockwise_rows_and_cols_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blockwise_rows`` and ``quantize_blockwise_cols_grouped`` of ``x``, in one call.

    For MoE's ``x`` and ``grad_out`` (forward / dgrad need 1x128 blocks, wgrad
    per-group 128x1 blocks). The 1x128 part does not depend on the groups
    (every row is quantized, tokens past ``offs[-1]`` included). Two launches,
    each reading ``x``: faster than one read into both layouts (see the module
    docstring).

    Returns:
        ``(x_fp8 (M, K), scales (M, ceil(K/block)), xt_fp8 (K, R * block),
        scales_t (R, K), group_block_starts (G,))`` with ``R = ceil(M/block) +
        G``, the two functions' results.
    """
    _check_act(x, float8_dtype, block)
    check_offsets(offs, x.device)
    quant = (float8_dtype, round_scales_to_power_of_2, block)
    return (*quantize_blockwise_rows(x, *quant), *quantize_blockwise_cols_grouped(x, offs, *quant))


def _check_weight(w: object, float8_dtype: torch.dtype, block: int) -> torch.Tensor:
    if isinstance(w, torch.Tensor) and w.dim() not in (2, 3):
        raise ValueError(f"w must be 2-D (N, K) or 3-D (E, N, K), got shape {tuple(w.shape)}")
    w = check_tensor("w", w, ndim=w.dim() if isinstance(w, torch.Tensor) else 2, dtypes=FLOAT_INPUT_DTYPES)
    check_fp8_dtype(float8_dtype)
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block}")
    if w.numel() == 0:
        raise ValueError(f"w must have no empty dimension, got shape {tuple(w.shape)}")
    return w


def transposes_through_fp8_bytes(src: torch.Tensor) -> bool:
    """Whether the transposed weight layout is copied from the forward one instead of stored by the kernel.

    For float32 weights on a GPU: on the H200 (Triton 3.6) the kernel's transposed
    store of a float32 tile wrote NaN into some columns of the transposed weight
    (seen as NaN in the blockwise recipe's dgrad with float32 weights; bf16 is exact).
    """
    return src.dtype == torch.float32 and not on_cpu(src)


def _quantize_weight(
    w: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    block: int,
    store_q: bool,
    store_qt: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_weight(w, float8_dtype, block)
    batched = w.dim() == 3
    src = w if batched else w.unsqueeze(0)
    if store_qt and transposes_through_fp8_bytes(src):
        # A square block's scale and bits do not depend on the layout: the transposed
        # form is the forward form's bytes (``transpose_fp8``) and scales, transposed.
        q, q_scales, _, _, _ = _quantize_blocks(
            src, float8_dtype, round_scales_to_power_of_2, block, square=True, store_q=True, store_qt=False
        )
        qt, qt_scales = transpose_fp8(q), q_scales.transpose(1, 2).contiguous()
        if not store_q:
            q, q_scales = q.new_empty((0, 0, 0)), q_scales.new_empty((0, 0, 0))
    else:
        q, q_scales, qt, qt_scales, _ = _quantize_blocks(
            src, float8_dtype, round_scales_to_power_of_2, block,
            square=True, store_q=store_q, store_qt=store_qt,
        )
    outputs = (q, q_scales, qt, qt_scales)
    # squeeze(0) drops the batch of a 2-D w and leaves unrequested (empty) outputs as they are.
    return outputs if batched else tuple(t.squeeze(0) for t in outputs)


def quantize_blockwise_weights(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights with one scale per ``block x block`` block.

    Args:
        w: ``(N, K)`` or ``(E, N, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        block: block side, one of ``BLOCK_SIZES`` (DeepSeek-V3: 128).

    Returns:
        ``(w_fp8, scales)``: ``w_fp8`` in ``w``'s layout; ``scales`` is
        ``(ceil(N/block), ceil(K/block))`` (or ``(E, ...)``) float32 row-major,
        ``w[..., n, k] ~= w_fp8[..., n, k] * scales[..., n // block, k // block]``.
    """
    q, q_scales, _, _ = _quantize_weight(w, float8_dtype, round_scales_to_power_of_2, block, True, False)
    return q, q_scales


def quantize_blockwise_weights_transposed(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blockwise_weights`` of ``w.transpose(-2, -1)``, written contiguous.

    Returns:
        ``(wt_fp8, scales_t)``: ``(K, N)`` / ``(E, K, N)`` contiguous and
        ``(ceil(K/block), ceil(N/block))`` / ``(E, ...)`` float32, the transpose
        of ``quantize_blockwise_weights``'s scales (same blocks, same values).
    """
    _, _, qt, qt_scales = _quantize_weight(w, float8_dtype, round_scales_to_power_of_2, block, False, True)
    return qt, qt_scales


def quantize_blockwise_weights_both_layouts(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    block: int = BLOCKWISE_SCALE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both weight layouts from one read of ``w`` (each tile is cast once, stored both ways).

    Returns:
        ``(w_fp8, scales, wt_fp8, scales_t)``, bitwise equal to
        ``quantize_blockwise_weights`` and ``quantize_blockwise_weights_transposed``.
    """
    return _quantize_weight(w, float8_dtype, round_scales_to_power_of_2, block, True, True)


# Tuning: each family of ``quantize_blockwise_kernel`` variants (``CONFIG_FAMILIES``) on its training call.
def _register_tuning(name: str) -> None:
    family = name.removeprefix("quantize_blockwise_")

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        if family == "weights":
            w = random_bf16(shape["E"], shape["N"], shape["K"], device=device)
            return lambda: quantize_blockwise_weights_both_layouts(w)
        x = random_bf16(shape["M"], shape["K"], device=device)
        if family == "cols_grouped":
            offs = routed_offsets(shape["M"], shape["G"], device)
            return lambda: quantize_blockwise_cols_grouped(x, offs)
        quantize = quantize_blockwise_rows if family == "rows" else quantize_blockwise_cols
        return lambda: quantize(x)

    def space(arch: str) -> list[helion.Config]:
        # The tile is the one big load (the grouped kernel first reads its block map: two G-lane vectors);
        # it is read once, so evict it first. Grid order [2, 1, 0] walks column blocks fastest
        # (reads in address order) instead of row blocks (transposed stores in address order).
        tile_load = 2 if family == "cols_grouped" else 0
        evict_tile = [""] * tile_load + ["first"]
        warps = warps_for(arch)
        configs = vary(DEFAULT_CONFIG, num_warps=warps)
        for extra in ({"load_eviction_policies": evict_tile}, {"loop_orders": [[2, 1, 0]]}):
            configs += vary(helion.Config(**{**DEFAULT_CONFIG.config, **extra}), num_warps=warps)
        if not is_amd(arch):
            # Two programs per SM: a weight tile stored both ways takes ~145 registers a thread at 8 warps
            # (one program per SM, so nothing loads while it computes); capped at 128 it spills at most 88 bytes.
            configs += vary(DEFAULT_CONFIG, pid_type=["persistent_interleaved"], num_sm_multiplier=[2],
                            maxnreg=[128], loop_orders=[[[0, 1, 2]], [[2, 1, 0]]])[1:]
        return configs

    if family == "weights":
        shapes = [{"E": 16, "N": 8192, "K": 5120}, {"E": 8, "N": 2048, "K": 7168}, {"E": 8, "N": 7168, "K": 2048}]
        test_shape = {"E": 2, "N": 130, "K": 257}
    elif family == "cols_grouped":
        shapes = [{"M": 32768, "K": k, "G": 8} for k in (2048, 5120, 7168)]
        test_shape = {"M": 130, "K": 257, "G": 3}
    else:
        shapes = [{"M": 32768, "K": k} for k in (2048, 5120, 7168)]
        test_shape = {"M": 130, "K": 257}
    register_tuning(name, DEFAULT_CONFIG, space, shapes, make_call, test_shape)


for _name in CONFIG_FAMILIES:
    _register_tuning(_name)
