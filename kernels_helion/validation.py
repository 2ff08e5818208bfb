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
OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)  # the GEMMs' outputs


def check_out_dtype(out_dtype: object) -> None:
    """Raise ``TypeError`` unless ``out_dtype`` is a supported GEMM output dtype."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    contiguous: bool = True,
    subclasses: tuple[type, ...] = (),
) -> torch.Tensor:
    """Check type, rank, dtype and (optionally) contiguity of argument ``name``.

    Kernels read a tensor's memory directly, so it must be a plain ``torch.Tensor``
    (or ``nn.Parameter``) with data: a tensor subclass (a sharded ``DTensor``, a
    wrapper whose storage is not its values) or a meta tensor is refused, unless
    its class is one of ``subclasses`` (whose callers take them apart).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_plain_tensor(name, t, subclasses)
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")
    return t


def check_matrices_row_major(name: str, t: torch.Tensor) -> None:
    """Raise unless each matrix of the batched ``(..., R, C)`` tensor ``t`` is row-major.

    The batch stride is free, so the two halves of a packed weight (``w[:, :H]`` and
    ``w[:, H:]`` of an ``(E, 2H, K)`` tensor) qualify.
    """
    rows, cols = t.shape[-2:]
    if t.stride(-1) != 1 or (rows > 1 and t.stride(-2) != cols):
        raise ValueError(f"{name} must hold row-major (..., {rows}, {cols}) matrices, got strides {t.stride()}")


def check_plain_tensor(name: str, t: torch.Tensor, subclasses: tuple[type, ...] = ()) -> None:
    """Raise unless ``t`` is a plain tensor with data (or an instance of one of ``subclasses``)."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter and not isinstance(t, subclasses):
        if cls.__name__ == "DTensor":
            placements = getattr(t, "placements", "?")
            raise TypeError(
                f"{name} is a DTensor (placements {placements}): the kernels take local tensors. Under FSDP2 run "
                "the module that fully_shard wrapped (it gathers its parameters before forward); otherwise pass "
                f"{name}.to_local() or {name}.full_tensor()"
            )
        # A subclass may say what to do instead (``kernel_input_hint``).
        hint = getattr(cls, "kernel_input_hint", "the kernels read its memory directly")
        raise TypeError(
            f"{name} must be a plain torch.Tensor, got the tensor subclass {cls.__module__}.{cls.__qualname__}: {hint}"
        )
    if t.is_meta:
        raise ValueError(
            f"{name} is a meta tensor (no data): materialize it first (e.g. module.to_empty(device=...) and "
            "initialize the parameters)"
        )


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
