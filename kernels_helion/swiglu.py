"""SwiGLU's backward in one pass: ``(grad_h, gate_up) -> grad_gate_up``.

With ``h = silu(gate) * up`` (``kernels_helion.grouped_gemm_swiglu``'s epilogue) and
``s = sigmoid(gate)``::

    grad_gate = grad_h * up * s * (1 + gate * (1 - s))
    grad_up   = grad_h * silu(gate)

computed in float32 from the stored values and rounded once. The result keeps
``gate_up``'s layout (each row its gate half, then its up half), which is the left
operand of the up-projection's dgrad (one GEMM over both halves: ``dx = grad_gate @
w1 + grad_up @ w3``) and, transposed, of its two wgrads. Eager PyTorch spends five
passes over these tensors (sigmoid, products, sums) where this reads each once.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_same_device, check_tensor
from kernels_helion.tuning import SWIGLU_SHAPES, random_bf16, vary

# block_sizes = [rows, hidden columns] per program.
DEFAULT_CONFIG = helion.Config(block_sizes=[16, 256], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def swiglu_backward_kernel(grad_h: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``grad_h (M, H)``, ``gate_up (M, 2, H)`` -> ``(M, 2, H)`` of ``grad_h``'s dtype."""
    m, n = grad_h.shape
    out = torch.empty([m, 2, n], dtype=grad_h.dtype, device=grad_h.device)
    for tile_m, tile_n in hl.tile([m, n]):
        grad = grad_h[tile_m, tile_n].to(torch.float32)
        gate = gate_up[tile_m, 0, tile_n].to(torch.float32)
        up = gate_up[tile_m, 1, tile_n].to(torch.float32)
        sig = torch.sigmoid(gate)
        out[tile_m, 0, tile_n] = (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(out.dtype)
        out[tile_m, 1, tile_n] = (grad * gate * sig).to(out.dtype)
    return out


def swiglu_backward(grad_h: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The gradients of ``gate`` and ``up`` from that of ``h = silu(gate) * up``.

    Args:
        grad_h: ``(M, H)`` bf16 / fp16 / fp32, contiguous.
        gate_up: ``(M, 2 * H)`` of ``grad_h``'s dtype, contiguous: each row its gate, then its up.

    Returns:
        ``(M, 2 * H)`` of ``grad_h``'s dtype: each row ``grad_gate``, then ``grad_up``.
    """
    check_tensor("grad_h", grad_h, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_tensor("gate_up", gate_up, ndim=2, dtypes=(grad_h.dtype,))
    check_same_device("gate_up", gate_up, grad_h.device)
    m, n = grad_h.shape
    if tuple(gate_up.shape) != (m, 2 * n):
        raise ValueError(f"gate_up must be (M, 2 * H) = {(m, 2 * n)} for grad_h {tuple(grad_h.shape)}, got {tuple(gate_up.shape)}")
    require_interpreter_on_cpu(grad_h)
    if m == 0 or n == 0:
        return torch.empty((m, 2 * n), dtype=grad_h.dtype, device=grad_h.device)
    config = select_config("swiglu_backward", {"M": m, "N": n}, DEFAULT_CONFIG)
    return launch(swiglu_backward_kernel, (grad_h, gate_up.view(m, 2, n)), config).view(m, 2 * n)


# Tuning: at the MoE layer benchmark's fused up-projections.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    grad_h = random_bf16(shape["M"], shape["N"], device=device)
    gate_up = random_bf16(shape["M"], 2 * shape["N"], device=device)
    return lambda: swiglu_backward(grad_h, gate_up)


def _tuning_space(arch: str) -> list[helion.Config]:
    return vary(DEFAULT_CONFIG, block_sizes=[[16, 256], [8, 256], [32, 128], [4, 512]], num_warps=[4, 8])


register_tuning("swiglu_backward", DEFAULT_CONFIG, _tuning_space, [{"M": m, "N": n} for m, n, _, _ in SWIGLU_SHAPES],
                _tuning_call, {"M": 70, "N": 48})
