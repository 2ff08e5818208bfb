"""Where each row sits in expert parallelism's exchanges: index maps computed on the device.

A rank's rows ``x_sorted`` are sorted by global expert, so the rows for EP rank ``d``
(experts ``[d L, (d + 1) L)``, ``L`` local experts) are one contiguous run. Received
rows arrive source-rank-major: from source rank ``s`` its rows for local expert ``0``,
then ``1``, ... The experts read them expert-major: local expert ``0``'s rows from every
source in rank order, then expert ``1``'s, ...

Two layouts of the exchange:

- **exact** (split sizes on the host): rank ``s`` sends exactly its rows, the receive
  buffer holds ``sum`` of the received counts;
- **capacity** ``C`` (fixed sizes, no host sync): each rank sends ``C`` rows to every
  rank, a block that holds its first ``min(n, C)`` rows for that rank and filler after
  them; the receive buffer holds ``ep * C`` rows, the experts get all of them, with the
  kept rows first (expert-major) and the filler past ``offs[-1]``, where the kernels
  read nothing. Rows past a block's ``C`` are dropped: they get no expert, their output
  and gradient are 0, and the count of them is reported (``ops.ep_overflow``).

Every map here is computed with fixed-size device ops (cumsum, searchsorted, gathers):
nothing reads a value on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class TokenRows(NamedTuple):
    """The caller's rows as token rows read by index: row ``i`` is ``x[token[i]]``; token ``t``'s rows are
    ``pairs[t]`` (``(T, k)``: the ``ops.MoE`` routing). The dispatch then gathers tokens into the send buffer
    (no ``(T * k, dim)`` copy), and its gradient sums each token's ``k`` rows (``sum_pair_rows``)."""

    token: Tensor
    pairs: Tensor


def expert_major_order(sizes: Tensor, starts: Tensor, slots: int, block: int | None = None) -> Tensor:
    """``(slots,)``: the receive-buffer slot of each expert-major row.

    ``sizes (ep, L)``: rows of source rank ``s`` for local expert ``l`` that the experts
    get; ``starts (ep, L)``: the slot of the first of them. Expert-major position ``p``
    lies in segment ``(l, s)`` (at flat index ``l * ep + s``). With ``block`` (capacity
    layout, source ``s`` owns slots ``[s * block, (s + 1) * block)``), positions past the
    kept rows take the unused slots in slot order, so the map is a permutation of
    ``[0, slots)``; without it ``slots`` must be ``sizes.sum()``.
    """
    ep, local = sizes.shape
    expert_major_sizes = sizes.t().flatten()
    expert_major_ends = expert_major_sizes.cumsum(0)
    position = torch.arange(slots, device=sizes.device)
    segment = torch.searchsorted(expert_major_ends, position, right=True).clamp_max(ep * local - 1)
    within = position - (expert_major_ends - expert_major_sizes)[segment]
    slot = starts[segment % ep, segment // ep] + within
    if block is None:
        return slot
    used = sizes.sum(1)
    free = block - used
    free_ends = free.cumsum(0)
    past = position - expert_major_ends[-1]  # >= 0: the past-th unused slot
    source = torch.searchsorted(free_ends, past, right=True).clamp_max(ep - 1)
    filler = source * block + used[source] + past - (free_ends - free)[source]
    return torch.where(past >= 0, filler, slot)


def inverse_permutation(order: Tensor) -> Tensor:
    """``inverse[order[i]] = i`` for a permutation ``order`` (a scatter without repeated indices: deterministic)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def exact_receive_order(recv_counts: Tensor, total: int) -> Tensor:
    """Exact layout: for ``recv_counts (ep, L)`` received rank-major, each expert-major row's position."""
    flat = recv_counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(recv_counts)
    return expert_major_order(recv_counts, starts, total)


class CapacitySend(NamedTuple):
    """The sender's side of a capacity exchange: which row fills each slot, where each row comes back."""

    pack: Tensor  # (ep * C,) row of x_sorted sent in each slot (filler slots: any row)
    unpack: Tensor  # (R,) slot each row's result comes back in; ep * C (one past the slots) for dropped rows
    dropped: Tensor  # () int64: rows routed into [0, E) but past a block's capacity


def capacity_send(counts: Tensor, rows: int, capacity: int) -> CapacitySend:
    """For ``counts (ep, L)`` (this rank's rows per destination rank and local expert) and ``rows`` rows."""
    ep = counts.shape[0]
    device = counts.device
    per_rank = counts.sum(1)
    kept_per_rank = per_rank.clamp_max(capacity)
    ends = per_rank.cumsum(0)
    starts = ends - per_rank
    slot = torch.arange(ep * capacity, device=device)
    dest, j = slot // capacity, slot % capacity
    pack = (starts[dest] + torch.minimum(j, kept_per_rank[dest] - 1).clamp_min(0)).clamp(0, max(rows - 1, 0))
    row = torch.arange(rows, device=device)
    row_dest = torch.searchsorted(ends, row, right=True)  # ep for rows past the counted ones
    in_range = row_dest < ep
    row_dest = row_dest.clamp_max(ep - 1)
    j_row = row - starts[row_dest]
    kept = in_range & (j_row < capacity)
    unpack = torch.where(kept, row_dest * capacity + j_row, ep * capacity)
    return CapacitySend(pack, unpack, (per_rank - kept_per_rank).sum())


class CapacityReceive(NamedTuple):
    """The receiver's side: the experts' row order over the ``ep * C`` slots, and their counts."""

    expert_major: Tensor  # (ep * C,) slot of each expert-major row (a permutation)
    source_major: Tensor  # (ep * C,) its inverse
    local_counts: Tensor  # (L,) kept rows per local expert


def capacity_receive(recv_counts: Tensor, capacity: int) -> CapacityReceive:
    """For ``recv_counts (ep, L)`` (rows each source rank has for each local expert), ``C`` slots per source."""
    ep = recv_counts.shape[0]
    block_starts = recv_counts.cumsum(1) - recv_counts
    kept = torch.minimum(recv_counts, (capacity - block_starts).clamp_min(0))
    starts = torch.arange(ep, device=recv_counts.device).unsqueeze(1) * capacity + block_starts
    expert_major = expert_major_order(kept, starts, ep * capacity, capacity)
    return CapacityReceive(expert_major, inverse_permutation(expert_major), kept.sum(0))
