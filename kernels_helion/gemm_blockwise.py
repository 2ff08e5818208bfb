"""Dense FP8 GEMMs with blockwise scales (DeepSeek-V3's recipe) for the three roles of a linear layer.

For ``y = x @ W.T`` with ``x (M, K)``, ``W (N, K)``, ``grad_out (M, N)``:

======== ======================= ========================================= ==========================================
role     product                 ``a`` (rows, C), scales                   ``b`` (cols, C), scales
======== ======================= ========================================= ==========================================
forward  ``y = x @ W.T`` (NT)    ``x`` (M, K), 1x128                       ``W`` (N, K), 128x128
dgrad    ``dx = dy @ W`` (NN)    ``dy`` (M, N), 1x128                      ``W.T`` stored (K, N), 128x128
wgrad    ``dW = dy.T @ x`` (TN)  ``dy.T`` stored (N, M), 128x1 (along M)   ``x.T`` stored (K, M), 128x1 (along M)
======== ======================= ========================================= ==========================================

Hopper's FP8 tensor cores (wgmma) read both operands contraction-major, so
every role takes its operands with the contraction dimension ``C`` contiguous,
as the quantizers write them (``kernels_helion.quantize_blockwise``): dgrad
takes the weight transposed (``quantize_blockwise_weights_transposed`` or
``quantize_blockwise_weights_both_layouts``, one read of ``W`` for both), wgrad takes both operands
transposed, tokens contiguous (``quantize_blockwise_cols`` / ``..._rows_and_cols``).
Every role is then one kernel, ``out = a @ b.T``, specialized at compile
time on how ``b``'s scales are laid out (one per 128x128 block, or one per row
and 128-wide contraction block). The output is ``(rows of a, rows of b)``
row-major, stored tile by tile with contiguous (TMA) stores, including wgrad's
``(N, K)``.

The scales vary along the contraction, so they cannot wait for the epilogue:
each 128-wide contraction step's product is scaled before it is added to the
fp32 accumulator (as DeepGEMM does). The contraction tile is therefore the scale
block (128) and, for 128x128 ``b`` scales, an output column tile lies in one
scale block (``BLOCK_N`` divides 128), so each step needs one ``b`` scale.

Fast path: with pointer loads (AMD, configs without TMA, the CPU interpreter),
a contraction length that is a multiple of 128 is passed as a compile-time
constant, so the loop has no tail and the loads no contraction mask (they stay
16-byte vectorized); one compile per such length. Other lengths share one
compiled kernel with a masked tail. TMA loads (the NVIDIA default) need no
masks at all, so they take the shared kernel whatever the length.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch
import triton

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import has_tma, launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK, check_fp8_dtype, fp8_bits_to_float, is_fnuz
from kernels_helion.validation import check_out_dtype, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import is_amd, random_bf16, two_programs_per_sm, vary

# How ``b``'s scales are laid out (the kernel's ``b_scale_rows``): one per 128x128
# block, ``(ceil(rows/128), ceil(C/128))`` (forward, dgrad), or one per row and
# contraction block, ``(ceil(C/128), rows)`` (wgrad).
BLOCK_SCALES = BLOCKWISE_SCALE_BLOCK
ROW_SCALES = 1

# block_sizes = [BLOCK_M, BLOCK_N] (BLOCK_K is BLOCKWISE_SCALE_BLOCK). The fallback for shapes
# the autotune cache does not hold: 128x128 output tiles (two fp32 tiles live per
# thread: the accumulator and the step's product), TMA loads and stores, L2-grouped
# tile order, persistent programs interleaved over the tiles.
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 128],
    num_warps=8,
    num_stages=4,
    l2_groupings=[8],
    indexing="tensor_descriptor",
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=1)


def _step_product(a_tile: torch.Tensor, b_tile: torch.Tensor, decode_bits: bool, fnuz: bool) -> torch.Tensor:
    """``a_tile @ b_tile.T`` in fp32; from uint8 bits decoded to fp32 on the CPU interpreter."""
    if decode_bits:
        return hl.dot(fp8_bits_to_float(a_tile, fnuz), fp8_bits_to_float(b_tile, fnuz).T)
    return hl.dot(a_tile, b_tile.T)


@helion.kernel(static_shapes=False)
def gemm_blockwise_kernel(
    a: torch.Tensor,
    a_scales_t: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out: torch.Tensor,
    b_scale_rows: hl.constexpr,
    even_k: hl.constexpr,
    accumulate: hl.constexpr,
    rows_aligned: hl.constexpr,
    decode_bits: hl.constexpr,
    fnuz: hl.constexpr,
) -> torch.Tensor:
    """``out = sum_kb (a[:, kb] @ b[:, kb].T) * a_scales_t[kb][:, None] * (b's scales of kb)``.

    ``a (M, K)``, ``b (N, K)`` FP8 (uint8 bits when ``decode_bits``), ``K``
    contiguous; ``a_scales_t (ceil(K/128), >= M)`` with contiguous rows;
    ``b_scales`` as ``b_scale_rows`` says (``BLOCK_SCALES`` / ``ROW_SCALES``).
    ``even_k``: ``K`` when it is a multiple of 128 and the loads are pointer
    loads (a compile-time loop bound: no tail masks), else 0. ``accumulate``: ``out`` is fp32 and the result is added to it.
    ``rows_aligned``: per tensor, whether its row stride is a multiple of 16
    bytes; Helion decides from it which tensors TMA can read, so it is part of
    the compile key.
    """
    m, k = a.shape
    n = b.size(0)
    k_end = even_k if even_k else k
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        # 128 is BLOCKWISE_SCALE_BLOCK (the contraction tile), written as a literal: Helion
        # proves a loop has no tail (no masks) only against a literal block size.
        for tile_k in hl.tile(k_end, block_size=128):
            product = _step_product(a[tile_m, tile_k], b[tile_n, tile_k], decode_bits, fnuz)
            row_scales = a_scales_t[tile_k.id, tile_m]
            if b_scale_rows == 1:  # ROW_SCALES
                col_scales = b_scales[tile_k.id, tile_n]
                acc = acc + product * (row_scales[:, None] * col_scales[None, :])
            else:
                # The N tile lies in one scale block (BLOCK_N divides 128).
                block_scale = hl.load(b_scales, [tile_n.begin // 128, tile_k.id])
                acc = acc + product * (row_scales * block_scale)[:, None]
        if accumulate:
            out[tile_m, tile_n] = out[tile_m, tile_n] + acc
        else:
            out[tile_m, tile_n] = acc.to(out.dtype)
    return out


def _check_operand(name: str, t: object) -> torch.Tensor:
    """A 2-D contiguous e4m3 operand; e4m3fnuz needs ROCm or the CPU interpreter."""
    if isinstance(t, torch.Tensor):
        check_fp8_dtype(t.dtype, name)
        if t.dtype == torch.float8_e4m3fnuz and t.device.type == "cuda" and torch.version.hip is None:
            raise TypeError(f"{name}: float8_e4m3fnuz GEMMs need a ROCm build of PyTorch; use float8_e4m3fn")
    return check_tensor(name, t, ndim=2, dtypes=(t.dtype,) if isinstance(t, torch.Tensor) else ())


def _check_operands(
    a_name: str, a: object, b_name: str, b: object, empty_contraction_ok: bool = False
) -> tuple[int, int, int]:
    """``a (R, C)`` and ``b (S, C)``: one FP8 dtype, one device, ``S >= 1``, ``C >= 1`` unless
    ``empty_contraction_ok``; returns ``(R, S, C)``."""
    _check_operand(a_name, a)
    _check_operand(b_name, b)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name} must have the dtype of {a_name} ({a.dtype}), got {b.dtype}")
    check_same_device(b_name, b, a.device)
    rows, contraction = a.shape
    cols, contraction_b = b.shape
    if contraction_b != contraction:
        raise ValueError(
            f"{b_name} must have {contraction} columns like {a_name} (the contraction), got shape {tuple(b.shape)}"
        )
    if cols == 0:
        raise ValueError(f"{b_name} must have at least one row, got shape {tuple(b.shape)}")
    if contraction == 0 and not empty_contraction_ok:
        raise ValueError(f"{a_name} must have at least one column (the contraction), got shape {tuple(a.shape)}")
    return rows, cols, contraction


def _check_row_block_scales(name: str, scales: object, rows: int, blocks: int, device: torch.device) -> torch.Tensor:
    """1x128 scales ``(rows, blocks)`` float32, K-block-major as ``quantize_blockwise_rows`` returns them.

    Returns the ``(blocks, rows)`` view with contiguous rows that the kernel reads.
    """
    check_tensor(name, scales, ndim=2, dtypes=(torch.float32,), contiguous=False)
    assert isinstance(scales, torch.Tensor)
    if tuple(scales.shape) != (rows, blocks):
        raise ValueError(f"{name} must have shape {(rows, blocks)}, got {tuple(scales.shape)}")
    check_same_device(name, scales, device)
    scales_t = scales.t()
    if (rows > 1 and scales_t.stride(1) != 1) or (blocks > 1 and scales_t.stride(0) < rows):
        raise ValueError(
            f"{name} must be K-block-major as quantize_blockwise_rows returns it (strides (1, s) with s >= {rows}), "
            f"got strides {scales.stride()}"
        )
    return scales_t


def _rows_aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Per 2-D tensor: whether its rows start on 16-byte boundaries (TMA's rule for strides)."""
    return tuple(t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def _tma_loads(config: helion.Config, device: torch.device) -> bool:
    """Whether the operands load through TMA descriptors: asked for, and an NVIDIA GPU from Hopper on."""
    return config.config.get("indexing") == "tensor_descriptor" and has_tma(device)


def _launch_gemm(
    a: torch.Tensor,
    a_scales_t: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out: torch.Tensor,
    b_scale_rows: int,
    accumulate: bool,
    config_name: str,
) -> torch.Tensor:
    """Pick the config and the compile-time specializations, launch, return ``out``."""
    require_interpreter_on_cpu(a)
    m, k = a.shape
    n = b.size(0)
    cpu = on_cpu(a)
    config = select_config(config_name, {"M": m, "N": n, "K": k}, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    block_n = config.config["block_sizes"][1]
    if b_scale_rows == BLOCK_SCALES and BLOCKWISE_SCALE_BLOCK % block_n:
        raise ValueError(f"{config_name} config: BLOCK_N must divide {BLOCKWISE_SCALE_BLOCK}, got {block_n}")
    fnuz = is_fnuz(a.dtype)
    if cpu:
        # The interpreter has no e4m3fnuz type: the kernel reads bits and decodes them.
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    even_k = k if k % BLOCKWISE_SCALE_BLOCK == 0 and not _tma_loads(config, a.device) else 0
    rows_aligned = _rows_aligned(a, a_scales_t, b, b_scales, out)
    args = (a, a_scales_t, b, b_scales, out, b_scale_rows, even_k, accumulate, rows_aligned, cpu, fnuz)
    launch(gemm_blockwise_kernel, args, config)
    return out


def _act_times_weight(
    act: tuple[str, torch.Tensor, torch.Tensor],
    weight: tuple[str, torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    config_name: str,
) -> torch.Tensor:
    """``act @ weight.T`` with 1x128 ``act`` and 128x128 ``weight`` scales: forward and dgrad.

    ``act`` and ``weight`` are ``(name, tensor, scales)``; the names go into the error messages.
    """
    (a_name, a, a_scales), (b_name, b, b_scales) = act, weight
    m, n, k = _check_operands(a_name, a, b_name, b)
    k_blocks = triton.cdiv(k, BLOCKWISE_SCALE_BLOCK)
    a_scales_t = _check_row_block_scales(f"{a_name}_scales", a_scales, m, k_blocks, a.device)
    check_scales(f"{b_name}_scales", b_scales, (triton.cdiv(n, BLOCKWISE_SCALE_BLOCK), k_blocks), a.device)
    check_out_dtype(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    return _launch_gemm(a, a_scales_t, b, b_scales, out, BLOCK_SCALES, False, config_name)


def gemm_blockwise_forward(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Forward of a linear layer, ``y = x @ w.T`` (NT), with 1x128 ``x`` and 128x128 ``w`` scales.

    ``y[i, j] = sum_kb (x[i, kb] @ w[j, kb]) * x_scales[i, kb] * w_scales[j // 128, kb]``
    over the 128-wide blocks ``kb`` of ``K``. ``M``, ``N``, ``K`` need not be
    multiples of 128.

    Args:
        x: ``(M, K)`` float8_e4m3fn (e4m3fnuz on ROCm or CPU), contiguous,
            from ``quantize_blockwise_rows``.
        x_scales: ``(M, ceil(K/128))`` float32, K-block-major (strides ``(1, s)``,
            ``s >= M``) as ``quantize_blockwise_rows`` returns it.
        w: ``(N, K)`` float8 (``x``'s dtype), contiguous, from ``quantize_blockwise_weights``.
        w_scales: ``(ceil(N/128), ceil(K/128))`` float32, contiguous.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    return _act_times_weight(("x", x, x_scales), ("w", w, w_scales), out_dtype, "gemm_blockwise_forward")


def gemm_blockwise_dgrad(
    grad_out: torch.Tensor,
    grad_out_scales: torch.Tensor,
    w_t: torch.Tensor,
    w_t_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Input gradient of a linear layer, ``dx = grad_out @ w`` (NN), with the weight given transposed.

    ``dx[i, j] = sum_nb (grad_out[i, nb] @ w_t[j, nb]) * grad_out_scales[i, nb] * w_t_scales[j // 128, nb]``
    over the 128-wide blocks ``nb`` of ``N`` (the contraction). ``w_t`` is
    ``w.T`` stored contiguous (``N`` contiguous, as the tensor cores need), with
    the 128x128 scales of ``w`` transposed: ``quantize_blockwise_weights_transposed(w)``
    or the last two outputs of ``quantize_blockwise_weights_both_layouts(w)``.

    Args:
        grad_out: ``(M, N)`` float8, contiguous, from ``quantize_blockwise_rows``.
        grad_out_scales: ``(M, ceil(N/128))`` float32, K-block-major (as ``x_scales``
            in ``gemm_blockwise_forward``).
        w_t: ``(K, N)`` float8 (``grad_out``'s dtype), contiguous.
        w_t_scales: ``(ceil(K/128), ceil(N/128))`` float32, contiguous.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(M, K)`` tensor of ``out_dtype``.
    """
    return _act_times_weight(
        ("grad_out", grad_out, grad_out_scales), ("w_t", w_t, w_t_scales), out_dtype, "gemm_blockwise_dgrad"
    )


def gemm_blockwise_wgrad(
    grad_out_t: torch.Tensor,
    grad_out_t_scales: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scales: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Weight gradient of a linear layer, ``dw = grad_out.T @ x`` (TN), contracting over the ``M`` tokens.

    ``dw[i, j] = sum_mb (grad_out_t[i, mb] @ x_t[j, mb]) * grad_out_t_scales[mb, i] * x_t_scales[mb, j]``
    over the 128-token blocks ``mb``. Both operands are transposed, tokens
    contiguous, with one scale per 128x1 block (128 tokens of one column), as
    ``quantize_blockwise_cols`` (or the last two outputs of
    ``quantize_blockwise_rows_and_cols``) returns them for ``grad_out (M, N)`` and
    ``x (M, K)``. ``M`` need not be a multiple of 128; ``M = 0`` gives zeros.

    Args:
        grad_out_t: ``(N, M)`` float8, contiguous.
        grad_out_t_scales: ``(ceil(M/128), N)`` float32, contiguous.
        x_t: ``(K, M)`` float8 (``grad_out_t``'s dtype), contiguous.
        x_t_scales: ``(ceil(M/128), K)`` float32, contiguous.
        out: optional ``(N, K)`` float32 contiguous accumulator: the result is
            added to it in place (``out += ...``, fused gradient accumulation)
            and it is returned.
        out_dtype: dtype of a new output (bfloat16, float16, float32) when ``out`` is None.

    Returns:
        ``(N, K)`` row-major: ``out`` when given, else a new tensor of ``out_dtype``.
    """
    n, k, m = _check_operands("grad_out_t", grad_out_t, "x_t", x_t, empty_contraction_ok=True)
    m_blocks = triton.cdiv(m, BLOCKWISE_SCALE_BLOCK)
    device = grad_out_t.device
    check_scales("grad_out_t_scales", grad_out_t_scales, (m_blocks, n), device)
    check_scales("x_t_scales", x_t_scales, (m_blocks, k), device)
    if out is None:
        check_out_dtype(out_dtype)
        out = torch.empty((n, k), dtype=out_dtype, device=device)
        accumulate = False
    else:
        check_tensor("out", out, ndim=2, dtypes=(torch.float32,))
        if tuple(out.shape) != (n, k):
            raise ValueError(f"out must have shape {(n, k)}, got {tuple(out.shape)}")
        check_same_device("out", out, device)
        accumulate = True
    if m == 0:
        return out if accumulate else out.zero_()
    return _launch_gemm(grad_out_t, grad_out_t_scales, x_t, x_t_scales, out, ROW_SCALES, accumulate, "gemm_blockwise_wgrad")


# Tuning: a Llama-3-8B dense layer's GEMMs at 8192 tokens, (N, K) per forward: attention out (and
# approximately qkv), MLP up/gate, MLP down; dgrad and wgrad tune on the same layers. The key
# (M, N, K) is the launcher's (a's rows, b's rows, contraction).
_DENSE_LAYERS = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]


def _register_tuning(role: str) -> None:
    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        from kernels_helion.quantize_blockwise import (
            quantize_blockwise_cols,
            quantize_blockwise_rows,
            quantize_blockwise_weights,
        )

        m, n, k = shape["M"], shape["N"], shape["K"]
        if role == "wgrad":
            # (N, K) = a_t (N, M) @ b_t (K, M)^T: the contraction M is the tokens.
            a_t, a_scales = quantize_blockwise_cols(random_bf16(k, m, device=device))
            b_t, b_scales = quantize_blockwise_cols(random_bf16(k, n, device=device))
            return lambda: gemm_blockwise_wgrad(a_t, a_scales, b_t, b_scales)
        a, a_scales = quantize_blockwise_rows(random_bf16(m, k, device=device))
        b, b_scales = quantize_blockwise_weights(random_bf16(n, k, device=device))
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
            configs += two_programs_per_sm(DEFAULT_CONFIG)
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
    register_tuning(f"gemm_blockwise_{role}", DEFAULT_CONFIG, space, shapes, make_call, {"M": 130, "N": 72, "K": 200},
                    exact=False)


for _role in ("forward", "dgrad", "wgrad"):
    _register_tuning(_role)
