"""Per-group offsets derived from ``offs`` on the device, in one small kernel.

Padding, the grouped blocked scale layouts and the grouped MX quantizer each
need, per token group, where it ends (``offs`` clamped into ``[0, num_tokens]``,
made non-decreasing by a running max) and where it lands in a layout that gives
every group a whole number of ``unit``-sized pieces: a cumulative sum over the
groups. As eager PyTorch ops this is about eight tiny kernels (clamp, running
max, shift, divide, sum...), whose GPU time exceeded the last 15% of a padding
copy and most of a blocked-layout kernel; here it is one program of G lanes
(``group_offsets``), or the same lanes computed inside a kernel that needs them
(``group_layout``; the grouped blocked scale layouts do so, saving a launch, and
the grouped MX quantizer's block map, which counts the 32-token cells each group
touches instead of rounding its size up).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from kernels_helion._launch import launch, require_interpreter_on_cpu


def group_lanes(groups: int) -> int:
    """The smallest power of two >= ``groups`` (>= 1): the width of a kernel's vector of per-group lanes.

    Launchers call this on every step; ``triton.next_power_of_2`` gives the same
    value for ``groups >= 1`` but is a Triton ``constexpr_function`` in Triton 3.6,
    about 2.6 us per host call against 0.3 us here.
    """
    return 1 << max(groups - 1, 0).bit_length()


def _running_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.maximum(a, b)


def group_layout(
    offs: torch.Tensor, num_tokens: int, unit: int, groups_pow2: int, count_touched_units: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side, one lane per group: ``(lanes, is_group, ends, layout_ends, amounts)`` (see ``group_offsets``).

    Each group's amount is its size rounded up to a multiple of ``unit`` or, with
    ``count_touched_units``, the number of aligned ``unit``-token cells it touches
    (0 when empty). ``groups_pow2`` lanes (a power of two >= G); lanes past G hold the last group's
    ``ends`` and ``layout_ends`` and a zero amount.
    """
    groups = offs.size(0)
    lanes = hl.arange(groups_pow2)
    is_group = lanes < groups
    # Lanes past G load 0 and come last: they change no group's running max.
    ends = hl.associative_scan(_running_max, torch.clamp(hl.load(offs, [lanes], extra_mask=is_group), 0, num_tokens), 0)
    starts = hl.associative_scan(
        _running_max, torch.clamp(hl.load(offs, [lanes - 1], extra_mask=is_group & (lanes > 0)), 0, num_tokens), 0
    )
    if count_touched_units:
        amounts = torch.where(ends > starts, (ends - 1) // unit - starts // unit + 1, 0)
    else:
        amounts = (ends - starts + (unit - 1)) // unit * unit
    amounts = torch.where(is_group, amounts, 0)
    return lanes, is_group, ends, hl.cumsum(amounts, 0), amounts


def _group_value(
    ends: torch.Tensor, g: torch.Tensor, valid: torch.Tensor, lanes: torch.Tensor | None
) -> torch.Tensor:
    """``ends[g]`` per index (0 where not ``valid``): gathered from memory, or selected from lanes."""
    if lanes is None:
        return hl.load(ends, [g], extra_mask=valid)
    picked = torch.sum(torch.where(lanes.unsqueeze(0) == g.unsqueeze(1), ends.unsqueeze(0), 0), dim=1)
    return torch.where(valid, picked, 0)


def owning_group(
    src_ends: torch.Tensor,
    dst_ends: torch.Tensor,
    dst_index: torch.Tensor,
    src_tail_end: int,
    dst_tail_end: int,
    lanes: torch.Tensor | None = None,
    is_group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``(src_start, src_end, dst_start, dst_end)`` of the group owning each of ``dst_index``.

    Group ``g`` copies source ``[src_ends[g-1], src_ends[g])`` to destination
    ``[dst_ends[g-1], dst_ends[g])`` (``dst_ends`` non-decreasing). Index ``r``
    belongs to the number of groups ending at or before it (an empty group ends
    where the previous one does, so it owns nothing); past the last group it is the
    tail, source ``[src_ends[-1], src_tail_end)`` to ``[dst_ends[-1], dst_tail_end)``.
    All G ends are compared at once (a reduction over G, padded to a power of two).

    The ends are ``(G,)`` tensors in memory, whose values are gathered per index, or,
    with ``lanes``/``is_group`` given, one lane per group as ``group_layout`` computes
    them, selected per index (a reduction over the lanes per value): for kernels that
    derive the ends themselves and look up few indices per program. Where a program
    looks up many (the padding copy's rows), the selects made it 1.6-1.9x slower
    than the gathers on the H200 (``docs/experiments.md``).
    """
    # hl.load and unsqueeze: in a helper, Helion traces t[None, :] as a slice it cannot lower.
    if lanes is None:
        num_groups = dst_ends.size(0)
        ended = hl.load(dst_ends, [slice(None)]).unsqueeze(0) <= dst_index.unsqueeze(1)
    else:
        num_groups = torch.sum(is_group.to(torch.int32), dim=0)
        ended = is_group.unsqueeze(0) & (dst_ends.unsqueeze(0) <= dst_index.unsqueeze(1))
    g = torch.sum(ended.to(torch.int32), dim=1)
    in_group = g < num_groups
    src_start = _group_value(src_ends, g - 1, g > 0, lanes)
    src_end = torch.where(in_group, _group_value(src_ends, g, in_group, lanes), src_tail_end)
    dst_start = _group_value(dst_ends, g - 1, g > 0, lanes)
    dst_end = torch.where(in_group, _group_value(dst_ends, g, in_group, lanes), dst_tail_end)
    return src_start, src_end, dst_start, dst_end


@helion.kernel(static_shapes=False)
def group_offsets_kernel(
    offs: torch.Tensor, num_tokens: int, unit: int, groups_pow2: hl.constexpr
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, cumulative ends, cumulative starts)`` of each group's amount (see ``group_offsets``)."""
    groups = offs.size(0)
    ends = torch.empty([groups], dtype=torch.int32, device=offs.device)
    layout_ends = torch.empty([groups], dtype=torch.int32, device=offs.device)
    layout_starts = torch.empty([groups], dtype=torch.int32, device=offs.device)
    for _ in hl.grid(1):
        lanes, is_group, end, layout_end, amount = group_layout(offs, num_tokens, unit, groups_pow2, False)
        hl.store(ends, [lanes], end, extra_mask=is_group)
        hl.store(layout_ends, [lanes], layout_end, extra_mask=is_group)
        hl.store(layout_starts, [lanes], layout_end - amount, extra_mask=is_group)
    return ends, layout_ends, layout_starts


# One program of G lanes: nothing to tune.
GROUP_OFFSETS_CONFIG = helion.Config(num_warps=4, num_stages=1)


def group_offsets(offs: torch.Tensor, num_tokens: int, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, layout_ends, layout_starts)``, int32 ``(G,)`` on ``offs``' device, from one launch, no host sync.

    ``ends``: ``offs`` clamped into ``[0, num_tokens]``, running max; group ``g`` is
    ``[ends[g-1], ends[g])``. Each group's amount is its size rounded up to a
    multiple of ``unit``; ``layout_ends`` is their cumulative sum and
    ``layout_starts`` the same, exclusive (from 0).
    ``offs`` is a checked non-empty int32 tensor.
    """
    require_interpreter_on_cpu(offs)
    args = (offs, num_tokens, unit, group_lanes(offs.numel()))
    return launch(group_offsets_kernel, args, GROUP_OFFSETS_CONFIG)


def aligned_group_ends(
    offs: torch.Tensor, num_tokens: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, padded_ends, padded_starts)``: groups padded to multiples of ``alignment`` (``group_offsets``)."""
    return group_offsets(offs, num_tokens, alignment)
