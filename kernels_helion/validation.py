"""Input checks shared by the launchers; each raises before any kernel launches.

Offsets (``offs``) follow ``torch._grouped_mm``: int32, shape ``(G,)``, the
cumulative end of each token group. Their *values* live on the device and are not
checked (that would need a device-to-host sync); instead every kernel clamps group
bounds into ``[0, total_tokens]``, so bad offsets give wrong groups, never
out-of-bounds memory accesses.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    contiguous: bool = True,
) -> torch.Tensor:
    """Check type, rank, dtype and (optionally) contiguity of argument ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")
    return t


def check_offsets(offs: object, device: torch.device, name: str = "offs") -> torch.Tensor:
    """Check that ``offs`` is a 1-D, non-empty, contiguous int32 tensor on ``device``."""
    check_tensor(name, offs, ndim=1, dtypes=(torch.int32,))
    assert isinstance(offs, torch.Tensor)
    if offs.numel() == 0:
        raise ValueError(f"{name} must hold at least one group end, got shape (0,)")
    check_same_device(name, offs, device)
    return offs


def check_scales(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Check a float32 contiguous scale tensor of exactly ``shape`` on ``device``."""
    check_tensor(name, t, ndim=len(shape), dtypes=(torch.float32,))
    assert isinstance(t, torch.Tensor)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    check_same_device(name, t, device)
    return t


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Raise if ``t`` is not on ``device``."""
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
