"""Device helper for quantizers that store a tile transposed with one scale per column.

Such a tile's values are multiplied by a vector that a column reduction of the
same tile produced, then cast to fp8 and stored transposed. Triton then keeps
the whole computation in the load's layout and transposes the fp8 result
through shared memory one byte at a time (sm90, 128x128 tile, 8 warps: 64
one-byte shared loads a thread). Read back from memory, the scale vector is a
fresh load, not tied to the reduction's layout, and Triton
transposes the 16-bit input instead, with ``ldmatrix.trans`` (8 of them a
thread), as it does when the scale is a scalar.
"""

from __future__ import annotations

import helion.language as hl
import torch


def reload_stored_scales(scales: torch.Tensor, index: list[object], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Device helper: ``scales[index]`` read back after this program stored it.

    The barrier makes every thread's store visible to every thread of the
    program (``bar.sync`` orders a block's global memory accesses), so the
    values read are exactly those stored. Where ``mask`` is False, 0 is read.
    """
    hl.inline_triton("tl.debug_barrier()", args=[], output_like=None)
    return hl.load(scales, index, extra_mask=mask)
