"""What the tuner tunes: for each kernel, its search space and the shapes to tune it on.

A ``TunableKernel`` builds inputs for one shape and returns a closure that calls
the kernel's *public launcher*; the tuner forces each candidate config through
``autotune_cache.forced_config``, so the key that is stored is exactly the key the
launcher computes at run time.

Search spaces are gated per architecture (the seed experience: AMD's 64-wide
wavefronts want other warps and stages than NVIDIA, and one vendor's space
regressed the other), and always contain the kernel's default config, so tuning
can only help.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import helion
import torch


@dataclass(frozen=True)
class TunableKernel:
    """A kernel the tuner knows: name, default config, per-arch space, shapes, inputs."""

    name: str
    default_config: helion.Config
    space: Callable[[str], list[helion.Config]]
    shapes: Sequence[dict[str, int]]
    make_call: Callable[[dict[str, int], torch.device], Callable[[], object]]
    # A small shape for checking configs on the CPU interpreter.
    test_shape: dict[str, int]
    # Outputs of candidate configs must equal the default's exactly (quantization) or closely (GEMMs).
    exact: bool = True


def is_amd(arch: str) -> bool:
    """Whether ``arch`` names an AMD GPU (CDNA, 64-wide wavefronts)."""
    return arch.startswith("gfx")


def vary(default: helion.Config, **choices: Sequence[object]) -> list[helion.Config]:
    """The default config plus every combination of ``choices`` applied to it (no duplicates)."""
    configs = [default]
    names = list(choices)
    for values in itertools.product(*(choices[n] for n in names)):
        candidate = helion.Config.from_dict({**default.config, **dict(zip(names, values))})
        if candidate not in configs:
            configs.append(candidate)
    return configs


def warps_for(arch: str) -> list[int]:
    """num_warps worth trying: AMD wavefronts are 64 wide, so fewer warps cover a tile."""
    return [2, 4, 8] if is_amd(arch) else [4, 8, 16]


def _activations(shape: dict[str, int], device: torch.device) -> torch.Tensor:
    return torch.randn(shape["M"], shape["K"], device=device, dtype=torch.bfloat16)


def _rowwise() -> TunableKernel:
    from kernels_helion import quantize_rowwise
    from kernels_helion.quantize_rowwise import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = _activations(shape, device)
        return lambda: quantize_rowwise(x)

    def space(arch: str) -> list[helion.Config]:
        return vary(DEFAULT_CONFIG, block_sizes=[[1], [2], [4]], num_warps=warps_for(arch))

    shapes = [{"M": m, "K": k} for m in (16384, 65536) for k in (2048, 5120, 7168)]
    return TunableKernel("quantize_rowwise", DEFAULT_CONFIG, space, shapes, make_call, {"M": 5, "K": 96})


def tunable_kernels() -> dict[str, TunableKernel]:
    """Every kernel the library ships configs for, by name."""
    specs = [_rowwise()]
    return {s.name: s for s in specs}
