"""Device helper: a scalar condition as a boolean that masks a tile's loads and stores."""

from __future__ import annotations

import torch


def scalar_mask(condition: torch.Tensor) -> torch.Tensor:
    """Device side: ``condition`` (a 0-d boolean, a comparison of scalars) as a mask for a tile.

    Use it for a scalar condition that masks a tile's load or store, alone or with
    ``&``/``|`` of a tile's mask. Triton's interpreter keeps a scalar comparison's
    result with its operands' integer type, so broadcast to a tile it becomes an
    integer mask, which triton 3.9's interpreter rejects ("mask has unsupported
    dtype"). A select of boolean constants is boolean there, and on the GPU it
    compiles to the condition itself. A condition on tile starts alone
    (``tile.begin == 0``, a symbolic bool, not a tensor) is a branch instead:
    ``if tile.begin == 0: ...``.
    """
    return torch.where(condition, True, False)
