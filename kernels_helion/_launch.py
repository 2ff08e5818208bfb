"""How launchers run a Helion kernel: with a chosen config, never an implicit search."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence

import helion
import torch
from helion.runtime.kernel import BoundKernel
from triton.runtime.errors import OutOfResources

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


def _fit_config(bound: BoundKernel, config: helion.Config) -> helion.Config:
    # A size-one dimension is specialized away (K == 1 leaves no reduction loop), so
    # a config tuned on larger shapes may carry per-loop options with no loop to apply to.
    loops = config.config.get("reduction_loops")
    if loops and len(bound.config_spec.reduction_loops) < len(loops):
        return helion.Config(**{key: value for key, value in config.config.items() if key != "reduction_loops"})
    return config


def _call_signature(args: tuple[object, ...]) -> tuple[object, ...]:
    # Exact shapes, strides, dtypes and devices: finer than Helion's own key, so
    # a hit here is always a hit there, at a fraction of its cost.
    return tuple(
        (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args
    )


# (id(kernel), id(config), call signature) -> (kernel, config, compiled function).
_compiled: dict[tuple[object, ...], tuple[helion.Kernel, helion.Config, Callable[..., object]]] = {}
_MAX_FAST_PATH_ENTRIES = 4096
_thread_state = threading.local()


def launch(kernel: helion.Kernel, args: Sequence[object], config: helion.Config) -> object:
    """Run ``kernel(*args)`` compiled with ``config`` (compilations are cached per config).

    Launchers call this on every training step, so repeated calls take a fast
    path: one dictionary lookup from the exact call signature to the compiled
    function (the kernel and config are kept alive by the entry, so their ids
    cannot be reused by other objects).
    """
    args = tuple(args)
    if not getattr(_thread_state, "allocator_set", False):
        # Device-side tensor descriptors need Triton's scratch allocator, which lives
        # in a context variable: Helion sets it only for host-side descriptors, and
        # autograd's backward threads start without it.
        helion.runtime.set_triton_allocator()
        _thread_state.allocator_set = True
    key = (id(kernel), id(config), _call_signature(args))
    entry = _compiled.get(key)
    if entry is None:
        if len(_compiled) >= _MAX_FAST_PATH_ENTRIES:  # many distinct shapes: start over
            _compiled.clear()
        run_config = config
        if str(config.config.get("pid_type", "flat")).startswith("persistent") and any(
            isinstance(a, torch.Tensor) and on_cpu(a) for a in args
        ):
            # Triton's interpreter cannot run persistent programs: same tiles, one program each
            # (without the options only persistent programs take).
            persistent_only = ("num_sm_multiplier", "maxnreg")
            flat = {key: value for key, value in config.config.items() if key not in persistent_only}
            run_config = helion.Config(**{**flat, "pid_type": "flat"})
        return _first_call(key, kernel, config, run_config, args)
    return entry[2](*args)


def _first_call(
    key: tuple[object, ...], kernel: helion.Kernel, config: helion.Config, run_config: helion.Config, args: tuple
) -> object:
    """Compile, run and remember ``kernel`` for a new call signature.

    A config is tuned for one output dtype and may need more shared memory for
    another (an fp32 epilogue tile is twice a bf16 one): when Triton reports that
    the compiled kernel does not fit, it is recompiled with one pipeline stage
    less, down to one. This happens before any launch, so nothing has run.
    """
    bound = _bind(kernel, args)
    while True:
        compiled = bound.compile_config(_fit_config(bound, run_config))
        try:
            result = compiled(*args)
        except OutOfResources:
            stages = int(run_config.config.get("num_stages", 1))
            if stages <= 1:
                raise
            run_config = helion.Config(**{**run_config.config, "num_stages": stages - 1})
            continue
        _compiled[key] = (kernel, config, compiled)
        return result
