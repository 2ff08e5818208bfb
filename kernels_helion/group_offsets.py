"""Per-group offsets derived from ``offs`` on the device, in one small kernel.

Padding, the grouped blocked scale layouts and the grouped MX quantizer each
need, per token group, where it ends (``offs`` clamped into ``[0, num_tokens]``,
made non-decreasing by a running max) and where it lands in a layout that gives
every group a whole number of ``unit``-sized pieces: a cumulative sum over the
groups. As eager PyTorch ops this is about eight tiny kernels (clamp, running
max, shift, divide, sum...), whose GPU time exceeded the last 15% of a padding
copy and most of a blocked-layout kernel; here it is one program of G lanes.
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


@helion.kernel(static_shapes=False)
def group_offsets_kernel(
    offs: torch.Tensor, num_tokens: int, unit: int, groups_pow2: hl.constexpr, count_touched_units: hl.constexpr
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, cumulative ends, cumulative starts)`` of each group's amount (see ``group_offsets``)."""
    groups = offs.size(0)
    ends = torch.empty([groups], dtype=torch.int32, device=offs.device)
    layout_ends = torch.empty([groups], dtype=torch.int32, device=offs.device)
    layout_starts = torch.empty([groups], dtype=torch.int32, device=offs.device)
    for _ in hl.grid(1):
        g = hl.arange(groups_pow2)
        is_group = g < groups
        # Lanes past G load 0 and come last: they change no group's running max.
        end = hl.associative_scan(_running_max, torch.clamp(hl.load(offs, [g], extra_mask=is_group), 0, num_tokens), 0)
        start = hl.associative_scan(
            _running_max, torch.clamp(hl.load(offs, [g - 1], extra_mask=is_group & (g > 0)), 0, num_tokens), 0
        )
        if count_touched_units:
            amount = torch.where(end > start, (end - 1) // unit - start // unit + 1, 0)
        else:
            amount = (end - start + (unit - 1)) // unit * unit
        amount = torch.where(is_group, amount, 0)
        layout_end = hl.cumsum(amount, 0)
        hl.store(ends, [g], end, extra_mask=is_group)
        hl.store(layout_ends, [g], layout_end, extra_mask=is_group)
        hl.store(layout_starts, [g], layout_end - amount, extra_mask=is_group)
    return ends, layout_ends, layout_starts


# One program of G lanes: nothing to tune.
GROUP_OFFSETS_CONFIG = helion.Config(num_warps=4, num_stages=1)


def group_offsets(
    offs: torch.Tensor, num_tokens: int, unit: int, count_touched_units: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, layout_ends, layout_starts)``, int32 ``(G,)`` on ``offs``' device, from one launch, no host sync.

    ``ends``: ``offs`` clamped into ``[0, num_tokens]``, running max; group ``g`` is
    ``[ends[g-1], ends[g])``. Each group's amount is its size rounded up to a
    multiple of ``unit`` or, with ``count_touched_units``, the number of aligned
    ``unit``-token cells it touches (0 when empty); ``layout_ends`` is their
    cumulative sum and ``layout_starts`` the same, exclusive (from 0).
    ``offs`` is a checked non-empty int32 tensor.
    """
    require_interpreter_on_cpu(offs)
    args = (offs, num_tokens, unit, group_lanes(offs.numel()), count_touched_units)
    return launch(group_offsets_kernel, args, GROUP_OFFSETS_CONFIG)


def aligned_group_ends(
    offs: torch.Tensor, num_tokens: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends, padded_ends, padded_starts)``: groups padded to multiples of ``alignment`` (``group_offsets``)."""
    return group_offsets(offs, num_tokens, alignment, count_touched_units=False)
