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

import kernels_helion  # noqa: F401  (helion's set-up, before helion)
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
    """num_warps worth trying for the memory-bound kernels.

    AMD wavefronts are 64 wide, so fewer warps cover a tile. On the H200, 2 warps were
    the fastest for transposing stores (the MX grouped quantizer: 227 us against 413 us
    with 4 warps at 32768x7168): fewer warps share each layout conversion.
    """
    return [2, 4, 8] if is_amd(arch) else [2, 4, 8, 16]


def _bf16(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def _uniform_offsets(tokens: int, groups: int, device: torch.device) -> torch.Tensor:
    ends = [(g + 1) * tokens // groups for g in range(groups)]
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _rowwise() -> TunableKernel:
    from kernels_helion import quantize_rowwise_rows
    from kernels_helion.quantize_rowwise import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = _bf16(shape["M"], shape["K"], device=device)
        return lambda: quantize_rowwise_rows(x)

    def space(arch: str) -> list[helion.Config]:
        return vary(DEFAULT_CONFIG, block_sizes=[[1], [2], [4]], num_warps=warps_for(arch))

    shapes = [{"M": m, "K": k} for m in (16384, 32768, 65536) for k in (2048, 5120, 7168)]
    # Fine-grained experts' weights as (E * N, K) rows (Qwen3-30B-A3B's w2 on 1 and 2 GPUs, its w1/w3).
    shapes += [{"M": m, "K": k} for m, k in ((131072, 768), (262144, 768), (196608, 2048))]
    return TunableKernel("quantize_rowwise_rows", DEFAULT_CONFIG, space, shapes, make_call, {"M": 5, "K": 96})


# Expert weights (E, N, K) of the MoE benchmark shapes.
_EXPERT_WEIGHT_SHAPES = [
    {"E": e, "N": n, "K": k}
    for e, n, k in (
        (16, 8192, 5120), (128, 8192, 5120), (8, 2048, 7168), (8, 7168, 2048), (32, 2048, 7168), (16, 1536, 2048)
    )
]


def _expert_weights(name: str) -> TunableKernel:
    """The two kernels of ``quantize_rowwise_expert_weights_both_layouts`` (amax pass, then the cast to both layouts)."""
    from kernels_helion import quantize_rowwise_expert_weights_both_layouts
    from kernels_helion.quantize_rowwise_weights import AMAX_DEFAULT_CONFIG, BOTH_LAYOUTS_CAST_DEFAULT_CONFIG

    default = {"quantize_rowwise_expert_weights_both_layouts_amax": AMAX_DEFAULT_CONFIG, "quantize_rowwise_expert_weights_both_layouts_cast": BOTH_LAYOUTS_CAST_DEFAULT_CONFIG}[name]

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        w = _bf16(shape["E"], shape["N"], shape["K"], device=device)
        return lambda: quantize_rowwise_expert_weights_both_layouts(w)

    def space(arch: str) -> list[helion.Config]:
        return vary(default, block_sizes=[[64, 64], [128, 64], [64, 128], [128, 128], [256, 64]], num_warps=warps_for(arch))

    return TunableKernel(name, default, space, _EXPERT_WEIGHT_SHAPES, make_call, {"E": 2, "N": 40, "K": 72})


def _transpose_fp8() -> TunableKernel:
    """``transpose_fp8`` on the expert weights' FP8 forward layout (the folded dgrad's ``W^T``)."""
    from kernels_helion import transpose_fp8
    from kernels_helion.transpose_fp8 import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        t = _bf16(shape["E"], shape["R"], shape["C"], device=device).to(torch.float8_e4m3fn)
        return lambda: transpose_fp8(t)

    def space(arch: str) -> list[helion.Config]:
        blocks = [[64, 128], [128, 128], [64, 256], [128, 256], [256, 128], [256, 256]]
        configs = vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))
        # 256x256 tiles at 16 warps write out of bounds on the H200 (illegal address,
        # Triton 3.6, even on a 2x40x72 tensor), which poisons the CUDA context.
        return [c for c in configs if not (c.config["block_sizes"] == [256, 256] and c.config["num_warps"] == 16)]

    shapes = [{"E": s["E"], "R": s["N"], "C": s["K"]} for s in _EXPERT_WEIGHT_SHAPES]
    return TunableKernel("transpose_fp8", DEFAULT_CONFIG, space, shapes, make_call, {"E": 2, "R": 40, "C": 72})


# Activations (M, K, G) of the MoE benchmark shapes (each GEMM's input and output widths).
_ACTIVATION_SHAPES = [
    {"M": m, "K": k, "G": g}
    for m, k, g in ((32768, 7168, 8), (32768, 2048, 8), (32768, 2048, 16), (32768, 1536, 16), (32768, 5120, 4),
                    (32768, 8192, 4), (65536, 7168, 32), (65536, 2048, 32), (32768, 5120, 64), (32768, 7168, 64),
                    (32768, 7168, 1), (65536, 5120, 1),
                    # fine-grained: Qwen3-30B-A3B's 128 experts (and 64 a GPU under EP=2), DeepSeek-V3's 256
                    (65536, 2048, 128), (65536, 1536, 128), (65536, 768, 128), (65536, 2048, 64), (65536, 768, 64),
                    (32768, 7168, 256), (32768, 4096, 256), (32768, 2048, 256))
]


def _transpose_token_groups() -> TunableKernel:
    """``transpose_to_token_groups`` on the rowwise FP8 input (the folded wgrad's ``x^T``)."""
    from kernels_helion import transpose_to_token_groups
    from kernels_helion.transpose_token_groups import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        t = _bf16(shape["M"], shape["K"], device=device).to(torch.float8_e4m3fn)
        offs = _uniform_offsets(shape["M"] - 7, shape["G"], device)
        return lambda: transpose_to_token_groups(t, offs)

    def space(arch: str) -> list[helion.Config]:
        # [token tile (a divisor of the recipes' alignment, 128), column tile]
        blocks = [[64, 128], [128, 128], [64, 256], [128, 256], [32, 256], [128, 64]]
        return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))

    return TunableKernel("transpose_to_token_groups", DEFAULT_CONFIG, space, _ACTIVATION_SHAPES, make_call,
                         {"M": 70, "K": 48, "G": 3})


# The MoE combine at Qwen3-30B-A3B's and DeepSeek-V3's widths, top-8, 8192 and 16384 tokens.
_COMBINE_SHAPES = [{"T": t, "D": d, "k": 8} for t in (8192, 16384) for d in (2048, 7168)]


def _moe_combine(name: str) -> TunableKernel:
    """The MoE layer's combine (``moe_combine``) and its two gradients."""
    from kernels_helion import moe_combine, moe_combine_grad_probs, moe_combine_grad_rows
    from kernels_helion.moe_combine import COMBINE_DEFAULT_CONFIG, GRAD_PROBS_DEFAULT_CONFIG, GRAD_ROWS_DEFAULT_CONFIG

    default = {"moe_combine": COMBINE_DEFAULT_CONFIG, "moe_combine_grad_rows": GRAD_ROWS_DEFAULT_CONFIG,
               "moe_combine_grad_probs": GRAD_PROBS_DEFAULT_CONFIG}[name]

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        tokens, top_k = shape["T"], shape["k"]
        y = _bf16(tokens * top_k, shape["D"], device=device)
        grad = _bf16(tokens, shape["D"], device=device)
        order = torch.randperm(tokens * top_k, device=device)
        inverse = torch.argsort(order).view(tokens, top_k)
        probs = torch.rand(tokens, top_k, device=device)
        if name == "moe_combine":
            return lambda: moe_combine(y, inverse, probs)
        if name == "moe_combine_grad_rows":
            return lambda: moe_combine_grad_rows(grad, order, probs, y)
        return lambda: moe_combine_grad_probs(grad, y, inverse)

    def space(arch: str) -> list[helion.Config]:
        rows = [8, 16, 32, 64] if name != "moe_combine_grad_probs" else [16, 32, 64, 128]
        return vary(default, block_sizes=[[r, c] for r in rows for c in (128, 256, 512)], num_warps=warps_for(arch))

    # grad_probs sums over D in column tiles: another tile width sums in another order.
    return TunableKernel(name, default, space, _COMBINE_SHAPES, make_call, {"T": 13, "D": 40, "k": 3},
                         exact=name != "moe_combine_grad_probs")


def _activation_rows_and_cols(name: str) -> TunableKernel:
    """The two passes of ``quantize_rowwise_rows_and_cols_grouped`` (amax, then the cast to rows and columns)."""
    from kernels_helion import quantize_rowwise_rows_and_cols_grouped
    from kernels_helion.quantize_rowwise_two_pass import AMAX_DEFAULT_CONFIG, CAST_DEFAULT_CONFIG

    amax = name == "quantize_rowwise_rows_and_cols_grouped_amax"

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = _bf16(shape["M"], shape["K"], device=device)
        offs = _uniform_offsets(shape["M"] - 7, shape["G"], device)
        return lambda: quantize_rowwise_rows_and_cols_grouped(x, offs)

    def space(arch: str) -> list[helion.Config]:
        # [token tile (a divisor of the recipes' alignment, 128), column tile]
        if amax:
            # Small tiles with few warps read fastest on the H200 (64x64 with 2 warps: 60-70% of
            # the copy rate, 128x128 with 4: 49-58%); the row amaxes are atomics either way.
            blocks = [[64, 64], [128, 64], [128, 128], [256, 64]]
            warps = [1, 2, 4]
        else:
            blocks = [[64, 64], [32, 128], [64, 128], [128, 64], [32, 256], [16, 256]]
            warps = [2, 4, 8]
        return vary(AMAX_DEFAULT_CONFIG if amax else CAST_DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps)

    return TunableKernel(name, AMAX_DEFAULT_CONFIG if amax else CAST_DEFAULT_CONFIG, space, _ACTIVATION_SHAPES, make_call,
                         {"M": 70, "K": 48, "G": 3})


def _groups_transposed(name: str) -> TunableKernel:
    """``quantize_groups_transposed_kernel`` per input layout: tokens strided (transposing) or contiguous."""
    from kernels_helion import quantize_rowwise_cols_grouped, quantize_rowwise_cols_grouped_from_transposed
    from kernels_helion.quantize_rowwise_grouped import DEFAULT_CONFIG

    transposing = name == "quantize_rowwise_cols_grouped"

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        if transposing:
            x = _bf16(shape["M"], shape["K"], device=device)
            return lambda: quantize_rowwise_cols_grouped(x, offs)
        xt = _bf16(shape["K"], shape["M"], device=device)
        return lambda: quantize_rowwise_cols_grouped_from_transposed(xt, offs)

    def space(arch: str) -> list[helion.Config]:
        # [tokens per step, columns per program]: a transposing read wants many
        # columns a step, a contiguous one many tokens.
        if transposing:
            blocks = [[256, 16], [128, 32], [256, 32], [128, 64]]
        else:
            blocks = [[256, 16], [512, 4], [512, 8], [256, 8], [512, 16], [128, 16]]
        return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))

    shapes = [{"M": 32768, "K": k, "G": g} for k in (5120, 7168) for g in (1, 16, 64)]
    return TunableKernel(name, DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "K": 48, "G": 3})


def _fp8_operands(*shape: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    data = (torch.randn(*shape, device=device) * 8).to(torch.float8_e4m3fn)
    scales = torch.rand(*shape[:-1], device=device) + 0.5
    return data, scales


# (M tokens, N, K, G) of the MoE benchmarks (benchmarks/grouped_gemm.py).
_MOE_GEMM_SHAPES = (
    (32768, 8192, 5120, 4),
    (32768, 2048, 7168, 8),
    (32768, 7168, 2048, 8),
    (32768, 1536, 2048, 16),
    (65536, 2048, 7168, 32),
)
# Fine-grained MoE expert GEMMs (Qwen3-30B-A3B and DeepSeek-V3: 128 and 256 experts, a few hundred
# tokens each); the rowwise GEMMs are tuned on them too.
_FINE_GRAINED_GEMM_SHAPES = (
    (65536, 1536, 2048, 128),
    (65536, 2048, 768, 128),
    (32768, 4096, 7168, 256),
    (32768, 7168, 2048, 256),
)
# The blockwise and MX GEMMs are tuned on the 32768-token shapes.
_GEMM_SHAPES = [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in _MOE_GEMM_SHAPES if m == 32768]
_GEMM_TEST_SHAPE = {"M": 70, "N": 32, "K": 64, "G": 3}


def _gemm_space(
    default: helion.Config,
    blocks: list[list[int]],
    stages: Sequence[int] = (3, 4),
    nvidia_warps: Sequence[int] = (8,),
    pid_types: Sequence[str] = (),
    two_per_sm: bool = False,
) -> Callable[[str], list[helion.Config]]:
    def space(arch: str) -> list[helion.Config]:
        warps = [4, 8] if is_amd(arch) else list(nvidia_warps)
        grids = {"pid_type": list(pid_types)} if pid_types else {}
        configs = vary(default, block_sizes=blocks, num_stages=list(stages), num_warps=warps, **grids)
        return configs + (_two_programs_per_sm(default) if two_per_sm and not is_amd(arch) else [])

    return space


def _two_programs_per_sm(default: helion.Config) -> list[helion.Config]:
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


def _grouped_mm_2d3d() -> TunableKernel:
    from kernels_helion import grouped_mm_2d3d
    from kernels_helion.grouped_gemm import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        a, a_scales = _fp8_operands(shape["M"], shape["K"], device=device)
        b, b_scales = _fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        return lambda: grouped_mm_2d3d(a, a_scales, b, b_scales, offs)

    space = _gemm_space(DEFAULT_CONFIG, [[128, 256, 128], [128, 128, 128], [256, 128, 128], [64, 256, 128]])
    # Forward (N, K) and dgrad (K, N) of each MoE shape.
    roles = dict.fromkeys(
        (m, n, k, g) for m, a, b, g in _MOE_GEMM_SHAPES + _FINE_GRAINED_GEMM_SHAPES for n, k in ((a, b), (b, a))
    )
    shapes = [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in roles]
    return TunableKernel("grouped_mm_2d3d", DEFAULT_CONFIG, space, shapes, make_call, _GEMM_TEST_SHAPE, exact=False)


# (M pairs, hidden, dim, G) of the fused up-projection: the MoE layer benchmark's configs.
_SWIGLU_SHAPES = (
    (65536, 768, 2048, 128),
    (262144, 768, 2048, 128),
    (65536, 2048, 7168, 256),
    (262144, 2048, 7168, 32),
)


def _grouped_mm_swiglu() -> TunableKernel:
    from kernels_helion import grouped_mm_swiglu
    from kernels_helion.grouped_gemm_swiglu import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        tokens = max(shape["M"] // 8, 1)
        a, a_scales = _fp8_operands(tokens, shape["K"], device=device)
        b_gate, gate_scales = _fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
        b_up, up_scales = _fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
        rows = torch.randint(0, tokens, (shape["M"],), dtype=torch.int32, device=device)
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        return lambda: grouped_mm_swiglu(a, a_scales, rows, b_gate, gate_scales, b_up, up_scales, offs)

    space = _gemm_space(
        DEFAULT_CONFIG, [[128, 128, 128], [128, 64, 128], [64, 128, 128], [128, 128, 64], [64, 256, 64]],
        nvidia_warps=(4, 8),
    )
    shapes = [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in _SWIGLU_SHAPES]
    return TunableKernel("grouped_mm_swiglu", DEFAULT_CONFIG, space, shapes, make_call, _GEMM_TEST_SHAPE, exact=False)


def _swiglu_backward() -> TunableKernel:
    from kernels_helion import swiglu_backward
    from kernels_helion.swiglu import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        grad_h = _bf16(shape["M"], shape["N"], device=device)
        gate_up = _bf16(shape["M"], 2 * shape["N"], device=device)
        return lambda: swiglu_backward(grad_h, gate_up)

    space = lambda arch: vary(  # noqa: E731
        DEFAULT_CONFIG, block_sizes=[[16, 256], [8, 256], [32, 128], [4, 512]], num_warps=[4, 8]
    )
    shapes = [{"M": m, "N": n} for m, n, _, _ in _SWIGLU_SHAPES]
    return TunableKernel("swiglu_backward", DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "N": 48})


def _grouped_mm_wgrad() -> TunableKernel:
    from kernels_helion import grouped_mm_wgrad
    from kernels_helion.grouped_gemm_wgrad import DEFAULT_CONFIG
    from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        # The recipe's operands: the padded token layout (each group from a multiple of 128 columns).
        columns = padded_token_count(shape["M"], shape["G"], WGRAD_GROUP_ALIGNMENT)
        a_t, _ = _fp8_operands(shape["N"], columns, device=device)
        b_t, _ = _fp8_operands(shape["K"], columns, device=device)
        a_scales = torch.rand(shape["G"], shape["N"], device=device) + 0.5
        b_scales = torch.rand(shape["G"], shape["K"], device=device) + 0.5
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        return lambda: grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, group_alignment=WGRAD_GROUP_ALIGNMENT)

    space = _gemm_space(DEFAULT_CONFIG, [[256, 128], [128, 128], [128, 256]], stages=(3, 4, 5))

    shapes = [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in _MOE_GEMM_SHAPES + _FINE_GRAINED_GEMM_SHAPES]
    return TunableKernel("grouped_mm_wgrad", DEFAULT_CONFIG, space, shapes, make_call,
                         {"M": 70, "N": 32, "K": 48, "G": 3}, exact=False)


def _blockwise(name: str) -> TunableKernel:
    """One family of ``quantize_blocks_kernel`` variants (``CONFIG_FAMILIES``), tuned on its training call."""
    import kernels_helion as kernels
    from kernels_helion.quantize_blockwise import DEFAULT_CONFIG

    family = name.removeprefix("quantize_blockwise_")

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        if family == "weights":
            w = _bf16(shape["E"], shape["N"], shape["K"], device=device)
            return lambda: kernels.quantize_blockwise_weights_both_layouts(w)
        x = _bf16(shape["M"], shape["K"], device=device)
        if family == "cols_grouped":
            offs = _uniform_offsets(shape["M"], shape["G"], device)
            return lambda: kernels.quantize_blockwise_cols_grouped(x, offs)
        quantize = kernels.quantize_blockwise_rows if family == "rows" else kernels.quantize_blockwise_cols
        return lambda: quantize(x)

    def space(arch: str) -> list[helion.Config]:
        # The tile is the one big load (the grouped kernel first reads its block map: two G-lane vectors);
        # it is read once, so evict it first. Grid order [2, 1, 0] walks column blocks fastest
        # (reads in address order) instead of row blocks (transposed stores in address order).
        tile_load = 2 if family == "cols_grouped" else 0
        evict_tile = [""] * tile_load + ["first"]
        warps = warps_for(arch)
        configs = vary(DEFAULT_CONFIG, num_warps=warps)
        for extra in ({"load_eviction_policies": evict_tile}, {"loop_orders": [[2, 1, 0]]}):
            configs += vary(helion.Config(**{**DEFAULT_CONFIG.config, **extra}), num_warps=warps)
        if not is_amd(arch):
            # Two programs per SM: a weight tile stored both ways takes ~145 registers a thread at 8 warps
            # (one program per SM, so nothing loads while it computes); capped at 128 it spills at most 88 bytes.
            configs += vary(DEFAULT_CONFIG, pid_type=["persistent_interleaved"], num_sm_multiplier=[2],
                            maxnreg=[128], loop_orders=[[[0, 1, 2]], [[2, 1, 0]]])[1:]
        return configs

    if family == "weights":
        shapes = [{"E": 16, "N": 8192, "K": 5120}, {"E": 8, "N": 2048, "K": 7168}, {"E": 8, "N": 7168, "K": 2048}]
        test_shape = {"E": 2, "N": 130, "K": 257}
    elif family == "cols_grouped":
        shapes = [{"M": 32768, "K": k, "G": 8} for k in (2048, 5120, 7168)]
        test_shape = {"M": 130, "K": 257, "G": 3}
    else:
        shapes = [{"M": 32768, "K": k} for k in (2048, 5120, 7168)]
        test_shape = {"M": 130, "K": 257}
    return TunableKernel(name, DEFAULT_CONFIG, space, shapes, make_call, test_shape)


# The transposing MX quantizer (``quantize_mx_cols``, weights along N): [tokens (a multiple of 32), features]
# per program; the read is contiguous along the features, the store along the tokens.
_MX_TOKEN_TILES = [[64, 128], [32, 128], [32, 256], [64, 64], [64, 256], [128, 64], [128, 128], [32, 64]]


def _mx(name: str) -> TunableKernel:
    """The MX quantizers: ``quantize_mx_kernel`` (blocks along the contiguous dimension, rows) or
    ``quantize_mx_transposed_kernel`` (blocks along tokens, written transposed, cols)."""
    from kernels_helion import quantize_mx_rows, quantize_mx_cols, quantize_mx_expert_weights
    from kernels_helion.quantize_mx import DEFAULT_CONFIG, TRANSPOSED_DEFAULT_CONFIG

    transposed = name == "quantize_mx_cols"
    default = TRANSPOSED_DEFAULT_CONFIG if transposed else DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        if "E" in shape:
            # Expert weights (E, N=M, K) blocked along N: the same kernel, batched over experts.
            w = _bf16(shape["E"], shape["M"], shape["K"], device=device)
            return lambda: quantize_mx_expert_weights(w, transposed=True)
        x = _bf16(shape["M"], shape["K"], device=device)
        quantize = quantize_mx_cols if transposed else quantize_mx_rows
        return lambda: quantize(x)

    def space(arch: str) -> list[helion.Config]:
        if transposed:
            # Program order [tokens, features, experts] (fastest first) against the default
            # [experts, tokens, features]: on the H200, 81-89% of copy against 78-85% for
            # expert weights along N, the same for activations.
            orders = [[[1, 2, 0]], [[0, 1, 2]]]
            return vary(default, block_sizes=_MX_TOKEN_TILES, num_warps=warps_for(arch), loop_orders=orders)
        # [batches, rows, 32-element blocks] per program.
        blocks = [[1, 32, 4], [1, 8, 16], [1, 16, 8], [1, 4, 32], [1, 16, 16], [1, 2, 64], [1, 4, 64],
                  [1, 8, 32], [1, 2, 32]]
        configs = vary(default, block_sizes=blocks, num_warps=warps_for(arch))
        if not is_amd(arch):
            # TMA stores of the elements (load, scale store, element store: the memory ops in order).
            configs += vary(default, block_sizes=blocks, num_warps=[4, 8],
                            indexing=[["pointer", "pointer", "tensor_descriptor"]])[1:]
        return configs

    shapes = [{"M": 32768, "K": k} for k in (2048, 5120, 7168)]
    if transposed:
        shapes += [{"E": 16, "M": 1536, "K": 2048}, {"E": 8, "M": 2048, "K": 7168}, {"E": 4, "M": 8192, "K": 5120}]
    return TunableKernel(name, default, space, shapes, make_call, {"M": 64, "K": 96})


# Blocked MX scale layouts: [column tiles, row tiles] per program.
_MX_BLOCKED_BLOCKS = [[8, 2], [8, 1], [4, 2], [4, 4], [16, 1], [16, 2], [8, 4], [2, 4]]


def _mx_blocked_layout() -> TunableKernel:
    from kernels_helion import to_blocked_scales_grouped
    from kernels_helion.mx_blocked_layout import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        # Token-group scales, the recipe's case (the per-expert and plain layouts run the same kernel).
        scales = torch.randint(0, 255, (shape["R"], shape["C"]), dtype=torch.uint8, device=device)
        offs = _uniform_offsets(shape["R"] - 100, 16, device)
        return lambda: to_blocked_scales_grouped(scales, offs)

    def space(arch: str) -> list[helion.Config]:
        # block_sizes = [column tiles, row tiles] per program (512 bytes a tile): 2-16 KiB.
        return vary(DEFAULT_CONFIG, block_sizes=_MX_BLOCKED_BLOCKS, num_warps=warps_for(arch))

    shapes = [{"R": 32768, "C": c} for c in (64, 160, 224)]
    return TunableKernel("to_blocked_scales_grouped", DEFAULT_CONFIG, space, shapes, make_call, {"R": 200, "C": 9})


def _pad_groups() -> TunableKernel:
    from kernels_helion import pad_token_groups
    from kernels_helion.pad_groups import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = _bf16(shape["M"], shape["K"], device=device)
        offs = _uniform_offsets(shape["M"] - 7 * shape["G"], shape["G"], device)
        return lambda: pad_token_groups(x, offs, 128)

    def space(arch: str) -> list[helion.Config]:
        # [rows, columns] per program: wide rows for long contiguous accesses.
        blocks = [[16, 256], [8, 256], [32, 256], [16, 512], [8, 512], [32, 128], [64, 128], [4, 1024],
                  [8, 1024], [32, 512]]
        return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))

    shapes = [{"M": 32768, "K": k, "G": 16} for k in (2048, 5120, 7168)]
    return TunableKernel("pad_token_groups", DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "K": 48, "G": 3})


def _grouped_mm_2d3d_blockwise() -> TunableKernel:
    from kernels_helion import grouped_mm_2d3d_blockwise, quantize_blockwise_rows, quantize_blockwise_weights
    from kernels_helion.grouped_gemm_blockwise import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        a, a_scales = quantize_blockwise_rows(_bf16(shape["M"], shape["K"], device=device))
        b, b_scales = quantize_blockwise_weights(_bf16(shape["G"], shape["N"], shape["K"], device=device))
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        return lambda: grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs)

    # BLOCK_K is fixed at 128 and BLOCK_N must divide 128 (one weight scale per tile).
    space = _gemm_space(DEFAULT_CONFIG, [[128, 128], [64, 128], [256, 128]], two_per_sm=True)
    return TunableKernel("grouped_mm_2d3d_blockwise", DEFAULT_CONFIG, space, _GEMM_SHAPES, make_call,
                         _GEMM_TEST_SHAPE, exact=False)


def _grouped_mm_wgrad_blockwise() -> TunableKernel:
    from kernels_helion import grouped_mm_wgrad_blockwise, quantize_blockwise_cols_grouped
    from kernels_helion.grouped_gemm_wgrad_blockwise import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        a_t, a_scales, starts = quantize_blockwise_cols_grouped(_bf16(shape["M"], shape["N"], device=device), offs)
        b_t, b_scales, _ = quantize_blockwise_cols_grouped(_bf16(shape["M"], shape["K"], device=device), offs)
        return lambda: grouped_mm_wgrad_blockwise(a_t, a_scales, b_t, b_scales, offs, starts)

    space = _gemm_space(DEFAULT_CONFIG, [[128, 128], [64, 128], [128, 64]], two_per_sm=True)
    return TunableKernel("grouped_mm_wgrad_blockwise", DEFAULT_CONFIG, space, _GEMM_SHAPES, make_call,
                         _GEMM_TEST_SHAPE, exact=False)


def _grouped_mm_2d3d_mx() -> TunableKernel:
    from kernels_helion import grouped_mm_2d3d_mx, quantize_mx_rows, quantize_mx_expert_weights
    from kernels_helion.grouped_gemm_mx import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        a, a_scales = quantize_mx_rows(_bf16(shape["M"], shape["K"], device=device))
        b, b_scales = quantize_mx_expert_weights(_bf16(shape["G"], shape["N"], shape["K"], device=device))
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        return lambda: grouped_mm_2d3d_mx(a, a_scales, b, b_scales, offs)

    # The MX emulation rescales its accumulator every 32-wide K step: one warp group
    # on a 64-row tile (4 warps) measured 1.3-1.7x 128x128 with 8 warps, and a flat
    # grid 1.24-1.33x the persistent one: both grids are tried.
    # 2 stages won at one shape (+5.7% against 3).
    space = _gemm_space(DEFAULT_CONFIG, [[64, 128], [128, 128], [128, 256]], stages=(2, 3, 4), nvidia_warps=(4, 8),
                        pid_types=("flat", "persistent_interleaved"))
    return TunableKernel("grouped_mm_2d3d_mx", DEFAULT_CONFIG, space, _GEMM_SHAPES, make_call,
                         _GEMM_TEST_SHAPE, exact=False)


def _quantize_mx_grouped(name: str) -> TunableKernel:
    """``quantize_mx_grouped_kernel`` per family: 32x1 blocks only, or with the 1x32 (rows) copy too."""
    from kernels_helion import quantize_mx_cols_grouped, quantize_mx_rows_and_cols_grouped
    from kernels_helion.quantize_mx_grouped import DEFAULT_CONFIG

    quantize = quantize_mx_rows_and_cols_grouped if name == "quantize_mx_rows_and_cols_grouped" else quantize_mx_cols_grouped

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        x = _bf16(shape["M"], shape["C"], device=device)
        offs = _uniform_offsets(shape["M"] - 7 * 16, 16, device)
        return lambda: quantize(x, offs)

    def space(arch: str) -> list[helion.Config]:
        # [columns] of one 32-token cell per program. Few warps: on the H200, 1-2 warps won
        # at every shape and 4-8 warps ran 1.3-1.9x slower (transposed stores). Program
        # order of the cell loop: cells fastest, or column strips fastest (the rows-and-cols family's best
        # on the H200: 65536x7168 G=32 at 626 us against 750 us).
        columns = [[64], [128], [256], [32]]
        orders = [[[0, 1]], [[1, 0]]]
        warps = [1, 2, 4] if not is_amd(arch) else [1, 2]
        return vary(DEFAULT_CONFIG, block_sizes=columns, num_warps=warps, loop_orders=orders)

    shapes = [{"M": 32768, "C": c} for c in (2048, 5120, 7168)] + [{"M": 65536, "C": 7168}]
    return TunableKernel(name, DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "C": 64})


def _mx_blocked_layout_k_groups() -> TunableKernel:
    from kernels_helion import to_blocked_scales_k_groups
    from kernels_helion.mx_blocked_layout import K_GROUPS_DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        # The wgrad operands' (blocks, features) scales, laid out through their transpose.
        scales = torch.randint(0, 255, (shape["C"], shape["R"]), dtype=torch.uint8, device=device).t()
        offs = _uniform_offsets(shape["C"] - 16, 16, device)
        return lambda: to_blocked_scales_k_groups(scales, offs)

    def space(arch: str) -> list[helion.Config]:
        return vary(K_GROUPS_DEFAULT_CONFIG, block_sizes=_MX_BLOCKED_BLOCKS, num_warps=warps_for(arch))

    shapes = [{"R": r, "C": 32768 // 32 + 16} for r in (2048, 5120, 7168)]
    return TunableKernel("to_blocked_scales_k_groups", K_GROUPS_DEFAULT_CONFIG, space, shapes, make_call,
                         {"R": 200, "C": 40})


def _grouped_mm_wgrad_mx() -> TunableKernel:
    from kernels_helion import grouped_mm_wgrad_mx, quantize_mx_cols_grouped
    from kernels_helion.grouped_gemm_wgrad_mx import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        offs = _uniform_offsets(shape["M"], shape["G"], device)
        a_t, a_scales, block_offs = quantize_mx_cols_grouped(_bf16(shape["M"], shape["N"], device=device), offs)
        b_t, b_scales, _ = quantize_mx_cols_grouped(_bf16(shape["M"], shape["K"], device=device), offs)
        return lambda: grouped_mm_wgrad_mx(a_t, a_scales, b_t, b_scales, offs, block_offs)

    # Flat and persistent grids: the flat one runs 1.45-1.67x faster on the H200.
    space = _gemm_space(DEFAULT_CONFIG, [[64, 128], [128, 128], [128, 64], [256, 128]], nvidia_warps=(4, 8),
                        pid_types=("flat", "persistent_interleaved"))
    return TunableKernel("grouped_mm_wgrad_mx", DEFAULT_CONFIG, space, _GEMM_SHAPES, make_call,
                         _GEMM_TEST_SHAPE, exact=False)


# A Llama-3-8B dense layer's GEMMs at 8192 tokens, (N, K) per forward: attention out (and
# approximately qkv), MLP up/gate, MLP down; dgrad and wgrad tune on the same layers.
_DENSE_LAYERS = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]
_DENSE_TEST_SHAPE = {"M": 130, "N": 72, "K": 200}


def _gemm_blockwise(role: str) -> TunableKernel:
    """The dense blockwise GEMM for one role; key (M, N, K) is the launcher's (a's rows, b's rows, contraction)."""
    from kernels_helion import (
        gemm_blockwise_dgrad,
        gemm_blockwise_forward,
        gemm_blockwise_wgrad,
        quantize_blockwise_rows,
        quantize_blockwise_cols,
        quantize_blockwise_weights,
    )
    from kernels_helion.gemm_blockwise import DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        m, n, k = shape["M"], shape["N"], shape["K"]
        if role == "wgrad":
            # (N, K) = a_t (N, M) @ b_t (K, M)^T: the contraction M is the tokens.
            a_t, a_scales = quantize_blockwise_cols(_bf16(k, m, device=device))
            b_t, b_scales = quantize_blockwise_cols(_bf16(k, n, device=device))
            return lambda: gemm_blockwise_wgrad(a_t, a_scales, b_t, b_scales)
        a, a_scales = quantize_blockwise_rows(_bf16(m, k, device=device))
        b, b_scales = quantize_blockwise_weights(_bf16(n, k, device=device))
        launcher = gemm_blockwise_forward if role == "forward" else gemm_blockwise_dgrad
        return lambda: launcher(a, a_scales, b, b_scales)

    def space(arch: str) -> list[helion.Config]:
        # BLOCK_N divides 128 for the 128x128-scaled roles (one weight scale per tile);
        # wgrad's per-row scales allow wider N tiles.
        blocks = [[128, 128], [64, 128], [128, 64], [256, 128]] + ([[128, 256]] if role == "wgrad" else [])
        warps = [4, 8] if is_amd(arch) else [8]
        configs = vary(DEFAULT_CONFIG, block_sizes=blocks, num_stages=[3, 4, 5], num_warps=warps)
        if not is_amd(arch):
            # Two fp32 tiles live per thread (accumulator and the step's product): 256-row tiles
            # want four warpgroups.
            configs += vary(DEFAULT_CONFIG, block_sizes=[[256, 128]], num_warps=[16], num_stages=[3, 4])[1:]
            configs += _two_programs_per_sm(DEFAULT_CONFIG)
            if role == "wgrad":
                # One warpgroup a program on a flat grid: 1.06-1.08x the tuned persistent configs
                # for wgrad on the H200, 0.83-0.93x for the forward.
                configs += vary(DEFAULT_CONFIG, block_sizes=[[64, 128], [128, 64]], num_warps=[4], num_stages=[3, 4],
                                pid_type=["flat"])[1:]
        return configs

    tokens = 8192
    if role == "forward":
        shapes = [{"M": tokens, "N": n, "K": k} for n, k in _DENSE_LAYERS]
    elif role == "dgrad":
        shapes = [{"M": tokens, "N": k, "K": n} for n, k in _DENSE_LAYERS]
    else:
        shapes = [{"M": n, "N": k, "K": tokens} for n, k in _DENSE_LAYERS]
    shapes.append({"M": 8192, "N": 8192, "K": 8192})
    return TunableKernel(f"gemm_blockwise_{role}", DEFAULT_CONFIG, space, shapes, make_call,
                         _DENSE_TEST_SHAPE, exact=False)


def tunable_kernels() -> dict[str, TunableKernel]:
    """Every kernel the library ships configs for, by the name its launcher passes to ``select_config``."""
    from kernels_helion.quantize_blockwise import CONFIG_FAMILIES as BLOCKWISE_CONFIG_FAMILIES

    specs = [
        _rowwise(),
        _expert_weights("quantize_rowwise_expert_weights_both_layouts_amax"),
        _expert_weights("quantize_rowwise_expert_weights_both_layouts_cast"),
        _transpose_fp8(),
        _transpose_token_groups(),
        _moe_combine("moe_combine"),
        _moe_combine("moe_combine_grad_rows"),
        _moe_combine("moe_combine_grad_probs"),
        _activation_rows_and_cols("quantize_rowwise_rows_and_cols_grouped_amax"),
        _activation_rows_and_cols("quantize_rowwise_rows_and_cols_grouped_cast"),
        _groups_transposed("quantize_rowwise_cols_grouped"),
        _groups_transposed("quantize_rowwise_cols_grouped_from_transposed"),
        _grouped_mm_2d3d(),
        _grouped_mm_swiglu(),
        _swiglu_backward(),
        _grouped_mm_wgrad(),
        *(_blockwise(name) for name in BLOCKWISE_CONFIG_FAMILIES),
        _mx("quantize_mx_rows"),
        _mx("quantize_mx_cols"),
        _mx_blocked_layout(),
        _pad_groups(),
        _grouped_mm_2d3d_blockwise(),
        _grouped_mm_wgrad_blockwise(),
        _grouped_mm_2d3d_mx(),
        _quantize_mx_grouped("quantize_mx_cols_grouped"),
        _quantize_mx_grouped("quantize_mx_rows_and_cols_grouped"),
        _mx_blocked_layout_k_groups(),
        _grouped_mm_wgrad_mx(),
        _gemm_blockwise("forward"),
        _gemm_blockwise("dgrad"),
        _gemm_blockwise("wgrad"),
    ]
    return {s.name: s for s in specs}
