"""Rows that a fixed-capacity expert-parallel exchange could not deliver: counted on the device, reported without a host sync.

Each call of a capacity-mode ``ops.ExpertParallel`` ends its count exchange with, from
every source rank, ``[rows dropped past capacity, rows routed outside [0, E), the most
rows it had for one rank]``. Every rank receives every source's numbers, so every
rank's ``OverflowMonitor`` holds the same totals and makes the same decision at the same
call: no rank raises while another waits in a collective.

``on_overflow="raise"``: after each call the totals are copied to pinned host memory
(asynchronously) and an event is recorded; the next call of the same dispatcher, before
any collective, waits for that event, one call old, so the GPU never waits for the host,
and raises if anything was dropped. The error comes one call late: the call that
overflowed ran without the dropped rows (their outputs and gradients 0).
``check()`` reads the totals at once (a host sync the caller places, for example at
logging) and raises the same way; it changes nothing (the totals and the deferred check
stay as they were), so a rank that checks alone stays in step with the others. Under
CUDA-graph capture nothing is copied or waited for: the device totals still grow on every
replay, and ``check()`` reads them.

``on_overflow="drop"``: the rows past capacity are dropped (their pairs get no expert) and
counted; ``read()`` returns the totals (a host sync). Rows routed outside ``[0, E)`` are bad
input, not overflow: they are raised as with ``"raise"``, at the next call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ON_OVERFLOW = ("raise", "drop")
# Columns of the per-source numbers that travel with the counts.
DROPPED, MISROUTED, MOST_ROWS = 0, 1, 2


class CapacityOverflowError(RuntimeError):
    """Rows did not fit a capacity-mode expert-parallel exchange (``on_overflow="raise"``)."""


@dataclass(frozen=True)
class OverflowTotals:
    """Totals since the monitor was created or last raised, per source EP rank."""

    dropped: list[int]  # rows past a destination's capacity
    misrouted: list[int]  # rows routed outside [0, E) (dropped too)
    most_rows: int  # the most rows one rank had for one rank in one call (the capacity that would have sufficed)

    def error(self, capacity: int, num_experts: int, dropped: bool = True) -> Exception | None:
        """The exception these totals call for (rows past capacity only if ``dropped``), or ``None``."""
        if any(self.misrouted):
            ranks = [r for r, n in enumerate(self.misrouted) if n]
            return ValueError(
                f"routing: rows not covered by num_tokens_per_expert (top-k indices outside [0, {num_experts}), "
                f"rows and counts that differ, or negative counts) on EP ranks {ranks} "
                f"({[self.misrouted[r] for r in ranks]} rows); the capacity-mode exchange dropped them"
            )
        if dropped and any(self.dropped):
            return CapacityOverflowError(
                f"expert parallelism with capacity={capacity} rows per (source, destination) rank pair dropped "
                f"{sum(self.dropped)} rows (sent by EP ranks {[r for r, n in enumerate(self.dropped) if n]}): their "
                f"pairs got no expert, output and gradients 0. The most rows one rank had for one rank in a call "
                f"was {self.most_rows}: raise capacity to at least that, or pass on_overflow='drop' to accept "
                "counted drops"
            )
        return None


class OverflowMonitor:
    """The device totals of one capacity-mode dispatcher and their deferred check (see the module docstring)."""

    def __init__(self, capacity: int, num_experts: int, on_overflow: str) -> None:
        self.capacity = capacity
        self.num_experts = num_experts
        self.on_overflow = on_overflow
        self.totals: Tensor | None = None  # (ep, 3) int64 on the exchange's device
        self._host: Tensor | None = None  # pinned copy of the totals (CUDA)
        self._copied: torch.cuda.Event | None = None
        self._pending = False

    def add(self, received: Tensor) -> None:
        """Add one call's per-source numbers ``received (ep, 3)`` (int64, after the count exchange)."""
        # Outside inference mode even in an inference-mode call: the totals live on across calls.
        with torch.inference_mode(False):
            if self.totals is None:
                self.totals = torch.zeros(received.shape, dtype=received.dtype, device=received.device)
            self.totals[:, :MOST_ROWS] += received[:, :MOST_ROWS]
            torch.maximum(self.totals[:, MOST_ROWS], received[:, MOST_ROWS], out=self.totals[:, MOST_ROWS])
        if _capturing(received):
            return
        if received.is_cuda:
            if self._host is None:
                self._host = torch.empty(received.shape, dtype=received.dtype, pin_memory=True)
                self._copied = torch.cuda.Event()
            self._host.copy_(self.totals, non_blocking=True)
            self._copied.record()
        else:
            self._host = self.totals.clone()
        self._pending = True

    def before_call(self) -> None:
        """Raise for what the previous call dropped (``on_overflow="raise"``) or misrouted; waits only for
        that call's copy. Every rank runs it at the same call: the one place the totals are reset."""
        if not self._pending or (self.totals is not None and _capturing(self.totals)):
            return
        self._pending = False
        if self._copied is not None:
            self._copied.synchronize()
        error = self._totals_of(self._host).error(self.capacity, self.num_experts, self.on_overflow == "raise")
        if error is not None:
            self.totals.zero_()  # reported once: the layer goes on from zero
            raise error

    def read(self) -> OverflowTotals:
        """The totals now (a host sync)."""
        if self.totals is None:
            return OverflowTotals([], [], 0)
        return self._totals_of(self.totals.cpu())

    def check(self) -> OverflowTotals:
        """``read()``, raising as ``on_overflow="raise"`` does whatever the mode; changes nothing (a rank may
        check alone: the next call's check still runs on every rank alike)."""
        totals = self.read()
        error = totals.error(self.capacity, self.num_experts)
        if error is not None:
            raise error
        return totals

    @staticmethod
    def _totals_of(host: Tensor) -> OverflowTotals:
        rows = host.tolist()
        return OverflowTotals([r[DROPPED] for r in rows], [r[MISROUTED] for r in rows], max(r[MOST_ROWS] for r in rows))


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
