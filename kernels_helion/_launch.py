"""How launchers run a Helion kernel: with a chosen config, never an implicit search."""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import helion
import torch
from helion.runtime.kernel import BoundKernel

_bound_kernels: dict[Hashable, BoundKernel] = {}


def on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the CPU, where kernels run in Triton's interpreter."""
    return t.device.type == "cpu"


def require_interpreter_on_cpu(t: torch.Tensor) -> None:
    """Raise if a CPU tensor reaches a kernel while Triton's interpreter is off."""
    if on_cpu(t) and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Helion kernels run on CPU tensors only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing kernels_helion"
        )


def _bind(kernel: helion.Kernel, args: tuple[object, ...]) -> BoundKernel:
    # Helion 1.4's shape bucketing maps sizes 1 and >= 2 to one key but bakes a
    # size of 1 into code traced from such a call; keying on which sizes are 1
    # keeps such code away from calls with larger sizes.
    size_one = tuple(
        tuple(s == 1 for s in a.shape) for a in args if isinstance(a, torch.Tensor)
    )
    key = (id(kernel), kernel._base_specialization_key(args), size_one)
    bound = _bound_kernels.get(key)
    if bound is None:
        bound = _bound_kernels[key] = BoundKernel(kernel, args)
    return bound


def launch(kernel: helion.Kernel, args: Sequence[object], config: helion.Config) -> object:
    """Run ``kernel(*args)`` compiled with ``config`` (compilations are cached per config)."""
    args = tuple(args)
    # Device-side tensor descriptors need Triton's scratch allocator, which lives in a
    # context variable: Helion sets it only for host-side descriptors, and autograd's
    # backward threads start without it.
    helion.runtime.set_triton_allocator()
    if str(config.config.get("pid_type", "flat")).startswith("persistent") and any(
        isinstance(a, torch.Tensor) and on_cpu(a) for a in args
    ):
        # Triton's interpreter cannot run persistent programs: same tiles, one program each.
        config = helion.Config(**{**config.config, "pid_type": "flat"})
    return _bind(kernel, args).compile_config(config)(*args)
