"""The kernels the tuner knows, registered by the kernel modules themselves.

Each kernel module calls ``register_tuning`` beside its default config: its cache key
(the launcher's name, ``docs/kernels.md``), its search space per architecture, the
shapes to tune it on and a builder of a call to its public launcher. The tuner
forces each candidate config through ``autotune_cache.forced_config``, so the key it
stores is exactly the key the launcher computes at run time.

This module imports no kernel: the registry is filled when ``kernels_helion`` is
imported (``python -m kernels_helion.tune`` does that, then runs the tuner).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import helion
    import torch


@dataclass(frozen=True)
class TunableKernel:
    """A kernel the tuner knows: cache key, default config, per-arch space, shapes, inputs."""

    name: str
    default_config: helion.Config
    space: Callable[[str], list[helion.Config]]
    shapes: Sequence[dict[str, int]]
    make_call: Callable[[dict[str, int], torch.device], Callable[[], object]]
    # A small shape for checking configs on the CPU interpreter.
    test_shape: dict[str, int]
    # Outputs of candidate configs must equal the default's exactly (quantization) or closely (GEMMs).
    exact: bool = True
    # Small shapes of the launcher's other key forms, if its key has more than one (e.g. with ``T``
    # for the two-pass quantizer's gathered rows).
    other_test_shapes: Sequence[dict[str, int]] = ()


_registry: dict[str, TunableKernel] = {}


def register_tuning(
    name: str,
    default_config: helion.Config,
    space: Callable[[str], list[helion.Config]],
    shapes: Sequence[dict[str, int]],
    make_call: Callable[[dict[str, int], torch.device], Callable[[], object]],
    test_shape: dict[str, int],
    exact: bool = True,
    other_test_shapes: Sequence[dict[str, int]] = (),
) -> TunableKernel:
    """Record how to tune the kernel whose launcher asks ``select_config(name, ...)``.

    ``space(arch)`` lists candidate configs, the default first; ``make_call(shape, device)``
    builds inputs for one of ``shapes`` and returns a closure that calls the launcher.
    ``test_shape`` (and ``other_test_shapes``, one per further form of the launcher's key) are
    small shapes on which shipped configs are checked.
    Registering a name again (a re-imported module) replaces the earlier record.
    """
    spec = TunableKernel(name, default_config, space, shapes, make_call, test_shape, exact, other_test_shapes)
    _registry[name] = spec
    return spec


def tunable_kernels() -> dict[str, TunableKernel]:
    """Every registered kernel by cache key (empty until the kernel modules are imported)."""
    return dict(_registry)
