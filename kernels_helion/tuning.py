"""What the kernel modules share to describe their tuning: config spaces, inputs, benchmark shapes.

Each kernel module registers its search space and tuning shapes with
``autotune_cache.registry.register_tuning`` beside its default config. Search spaces
are gated per architecture (AMD's 64-wide wavefronts want other warps and stages than
NVIDIA, and one vendor's space regressed the other) and always start with the
kernel's default config, so tuning can only help.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import helion
import torch


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
    """num_warps worth trying for the memory-bound kernels.

    AMD wavefronts are 64 wide, so fewer warps cover a tile. On the H200, 2 warps were
    the fastest for transposing stores (the MX grouped quantizer: 227 us against 413 us
    with 4 warps at 32768x7168): fewer warps share each layout conversion.
    """
    return [2, 4, 8] if is_amd(arch) else [2, 4, 8, 16]


def random_bf16(*shape: int, device: torch.device) -> torch.Tensor:
    """A bfloat16 tensor of standard normal values."""
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def routed_offsets(tokens: int, groups: int, device: torch.device) -> torch.Tensor:
    """Group ends (int32 ``offs``) of ``tokens`` rows routed as a balanced router routes them.

    Each row goes to one of ``groups`` groups drawn uniformly at random (a fixed seed: the
    same sizes on every machine), so the sizes scatter about ``tokens / groups`` as an MoE
    layer's do (the Qwen3-30B-like layer's 512 rows an expert: 432-575) and most groups end
    in a partial tile. Equal sizes that are multiples of the tile never do: at 256 rows an
    expert the 2D x 3D GEMM took 19% longer on routed sizes than on equal ones on the H200,
    a cost a tuner that times equal groups cannot see (``docs/experiments.md``).
    """
    if groups <= 0:
        return torch.zeros(0, dtype=torch.int32, device=device)
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(groups, (max(tokens, 0),), generator=generator)
    counts = torch.bincount(picks, minlength=groups)
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def routed_pairs(tokens: int, top_k: int, groups: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair_tokens, offs)`` of ``tokens`` rows each routed to ``top_k`` distinct groups of ``groups``, as
    an MoE layer's pairs come to its experts: sorted by group, each group's tokens in ascending order
    (``pair_tokens``: int32, the token of each of the ``tokens * top_k`` pairs; ``offs``: int32 group ends).

    Kernels that read the pairs' token rows by index see the layer's order: the rows a group
    reads ascend, and each token's rows recur in ``top_k`` groups (a fixed seed, as ``routed_offsets``)."""
    generator = torch.Generator().manual_seed(0)
    picks = torch.rand(tokens, groups, generator=generator).topk(top_k, dim=1).indices.reshape(-1)
    order = torch.argsort(picks, stable=True)
    offs = torch.cumsum(torch.bincount(picks, minlength=groups), 0)
    return (order // top_k).to(device=device, dtype=torch.int32), offs.to(device=device, dtype=torch.int32)


def fp8_operands(*shape: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3fn operand of ``shape`` and fp32 scales over its last dimension."""
    data = (torch.randn(*shape, device=device) * 8).to(torch.float8_e4m3fn)
    scales = torch.rand(*shape[:-1], device=device) + 0.5
    return data, scales


def gemm_space(
    default: helion.Config,
    blocks: list[list[int]],
    stages: Sequence[int] = (3, 4),
    nvidia_warps: Sequence[int] = (8,),
    pid_types: Sequence[str] = (),
    two_per_sm: bool = False,
) -> Callable[[str], list[helion.Config]]:
    """A grouped GEMM's space: tiles x stages x warps (AMD: 4 and 8), optionally grids and 2 programs an SM."""

    def space(arch: str) -> list[helion.Config]:
        warps = [4, 8] if is_amd(arch) else list(nvidia_warps)
        grids = {"pid_type": list(pid_types)} if pid_types else {}
        configs = vary(default, block_sizes=blocks, num_stages=list(stages), num_warps=warps, **grids)
        return configs + (two_programs_per_sm(default) if two_per_sm and not is_amd(arch) else [])

    return space


def two_programs_per_sm(default: helion.Config) -> list[helion.Config]:
    """Block-scaled GEMMs at two persistent programs per SM, one warpgroup each (NVIDIA).

    Triton waits for each scaled step's wgmma before its FMAs into the accumulator;
    a second resident program issues its wgmma meanwhile. Two fp32 64x128 tiles
    (accumulator and step product) take ~152 registers a thread, so two 4-warp
    programs fit an SM. On the H200 the tuner chose them for the dense wgrad (+12-18%
    against the default), both grouped kernels (+0.5-20%) and the dense forward and
    dgrad at their larger shapes (+1-3%) (``docs/experiments.md``).
    """
    return vary(default, block_sizes=[[64, 128], [128, 64]], num_warps=[4], num_stages=[3, 4],
                pid_type=["persistent_interleaved"], num_sm_multiplier=[2])[1:]


# Expert weights (E, N, K) of the MoE benchmark shapes.
EXPERT_WEIGHT_SHAPES = [
    {"E": e, "N": n, "K": k}
    for e, n, k in (
        (16, 8192, 5120), (128, 8192, 5120), (8, 2048, 7168), (8, 7168, 2048), (32, 2048, 7168), (16, 1536, 2048)
    )
]

# Activations (M, K, G) of the MoE benchmark shapes (each GEMM's input and output widths).
ACTIVATION_SHAPES = [
    {"M": m, "K": k, "G": g}
    for m, k, g in ((32768, 7168, 8), (32768, 2048, 8), (32768, 2048, 16), (32768, 1536, 16), (32768, 5120, 4),
                    (32768, 8192, 4), (65536, 7168, 32), (65536, 2048, 32), (32768, 5120, 64), (32768, 7168, 64),
                    (32768, 7168, 1), (65536, 5120, 1),
                    # fine-grained: Qwen3-30B-A3B's 128 experts (and 64 a GPU under EP=2), DeepSeek-V3's 256
                    (65536, 2048, 128), (65536, 1536, 128), (65536, 768, 128), (65536, 2048, 64), (65536, 768, 64),
                    (32768, 7168, 256), (32768, 4096, 256), (32768, 2048, 256),
                    # the MoE layer benchmark's Qwen3-30B-like 32768-token batch (262144 pairs)
                    (262144, 2048, 128), (262144, 1536, 128), (262144, 768, 128),
                    # its DeepSeek-V3-like 32-expert layer: the up-projection's gradient (262144 pairs, 2 x 2048)
                    (262144, 4096, 32))
]

# (M tokens, N, K, G) of the MoE benchmarks (benchmarks/grouped_gemm.py).
MOE_GEMM_SHAPES = (
    (32768, 8192, 5120, 4),
    (32768, 2048, 7168, 8),
    (32768, 7168, 2048, 8),
    (32768, 1536, 2048, 16),
    (65536, 2048, 7168, 32),
)
# Fine-grained MoE expert GEMMs (Qwen3-30B-A3B and DeepSeek-V3: 128 and 256 experts, a few hundred
# tokens each); the rowwise GEMMs are tuned on them too.
FINE_GRAINED_GEMM_SHAPES = (
    (65536, 1536, 2048, 128),
    (65536, 2048, 768, 128),
    (32768, 4096, 7168, 256),
    (32768, 7168, 2048, 256),
)
# The MoE layer benchmark's expert GEMMs at its own row counts (top-8): the Qwen3-30B-like and
# DeepSeek-V3-like 32-expert layers at 32768 tokens, the 256-expert one at 8192. With only the
# shapes above, these ran the configs of a quarter as many rows.
MOE_LAYER_GEMM_SHAPES = (
    (262144, 2048, 768, 128),
    (262144, 1536, 2048, 128),
    (262144, 768, 2048, 128),
    (262144, 7168, 2048, 32),
    (262144, 2048, 7168, 32),
    (262144, 4096, 7168, 32),
    (65536, 7168, 2048, 256),
    (65536, 4096, 7168, 256),
)
# The blockwise and MX GEMMs are tuned on the 32768-token shapes.
GEMM_SHAPES = [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in MOE_GEMM_SHAPES if m == 32768]
GEMM_TEST_SHAPE = {"M": 70, "N": 32, "K": 64, "G": 3}

# (M pairs, hidden, dim, G) of the fused up-projection: the MoE layer benchmark's configs.
SWIGLU_SHAPES = (
    (65536, 768, 2048, 128),
    (262144, 768, 2048, 128),
    (65536, 2048, 7168, 256),
    (262144, 2048, 7168, 32),
)
