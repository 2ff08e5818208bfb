"""Dense linear layers in FP8 with blockwise scales (DeepSeek-V3's recipe): function, module, converter.

``y = x @ W.T (+ bias)`` with all three GEMMs in FP8 (``kernels_helion.gemm_blockwise``):

- forward: ``x`` 1x128-scaled, ``W`` 128x128-scaled;
- dgrad ``dx = dy @ W``: ``dy`` 1x128-scaled along ``N``, ``W.T`` as made in forward;
- wgrad ``dW = dy.T @ x``: ``dy`` and ``x`` 128x1-scaled along the tokens.

One read of each tensor gives every layout it is needed in (the quantizers'
``..._rows_and_cols`` and ``..._both_layouts`` variants). Saved for backward: ``x`` as its FP8 128x1-scaled transpose
``(K, M)`` (half the bytes of bf16 ``x``) and ``W.T`` in FP8 ``(K, N)``; only
what the needed gradients use. ``x`` may have any leading shape (flattened to
rows); ``bias`` is added in PyTorch (autograd gives its gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import ops.custom_ops_blockwise  # noqa: F401  (defines the fp8moe quantizers used below)
import ops.custom_ops_blockwise_dense  # noqa: F401  (defines the fp8moe dense GEMM ops used below)
from kernels_helion.fp8_format import check_fp8_dtype
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_same_device, check_tensor
from ops.modules import swap_modules
from ops.op_registry import kernel_ops

_ops = kernel_ops

FilterFn = Callable[[nn.Module, str], bool]

# The converter leaves layers with features not a multiple of this in high precision:
# FP8 rows of x, W and W.T then start on 16-byte boundaries, as TMA needs.
FEATURE_ALIGNMENT = 16


class Float8BlockwiseLinearFunction(torch.autograd.Function):
    """``(x (M, K), w (N, K)) -> (M, N)``, every GEMM in FP8 with blockwise scales."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, float8_dtype: torch.dtype, round_scales_to_power_of_2: bool) -> Tensor:
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        quant = (float8_dtype, round_scales_to_power_of_2)
        xt_fp8 = xt_scales = wt_fp8 = wt_scales = None
        if needs_dw:
            x_fp8, x_scales, xt_fp8, xt_scales = _ops.quantize_blockwise_rows_and_cols(x, *quant)
        else:
            x_fp8, x_scales = _ops.quantize_blockwise_rows(x, *quant)
        if needs_dx:
            w_fp8, w_scales, wt_fp8, wt_scales = _ops.quantize_blockwise_weights_both_layouts(w, *quant)
        else:
            w_fp8, w_scales = _ops.quantize_blockwise_weights(w, *quant)
        ctx.save_for_backward(xt_fp8, xt_scales, wt_fp8, wt_scales)
        ctx.quant = quant
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return _ops.gemm_blockwise_forward(x_fp8, x_scales, w_fp8, w_scales, x.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xt_fp8, xt_scales, wt_fp8, wt_scales = ctx.saved_tensors
        # Autograd may hand over an expanded (stride-0) gradient; the quantizers need rows.
        grad_out = grad_out.contiguous()
        dx = dw = None
        if needs_dx and needs_dw:
            go_fp8, go_scales, got_fp8, got_scales = _ops.quantize_blockwise_rows_and_cols(grad_out, *ctx.quant)
        elif needs_dx:
            go_fp8, go_scales = _ops.quantize_blockwise_rows(grad_out, *ctx.quant)
        elif needs_dw:
            got_fp8, got_scales = _ops.quantize_blockwise_cols(grad_out, *ctx.quant)
        if needs_dx:
            dx = _ops.gemm_blockwise_dgrad(go_fp8, go_scales, wt_fp8, wt_scales, ctx.x_dtype)
        if needs_dw:
            dw = _ops.gemm_blockwise_wgrad(got_fp8, got_scales, xt_fp8, xt_scales, ctx.w_dtype)
        return dx, dw, None, None


def _check_linear_inputs(x: object, weight: object, bias: object, float8_dtype: object) -> None:
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_INPUT_DTYPES, contiguous=False)
    assert isinstance(weight, Tensor)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_INPUT_DTYPES, contiguous=False)
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., {k}) (weight is (out_features={n}, in_features={k})), got {tuple(x.shape)}")
    if n == 0 or k == 0:
        raise ValueError(f"weight must have no empty dimension, got shape {tuple(weight.shape)}")
    check_same_device("weight", weight, x.device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_INPUT_DTYPES, contiguous=False)
        assert isinstance(bias, Tensor)
        if bias.shape[0] != n:
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        check_same_device("bias", bias, x.device)
    if not isinstance(float8_dtype, torch.dtype):
        raise TypeError(f"float8_dtype must be a torch.dtype, got {type(float8_dtype).__name__}")
    check_fp8_dtype(float8_dtype)
    if float8_dtype == torch.float8_e4m3fnuz and x.device.type == "cuda" and torch.version.hip is None:
        raise TypeError("float8_dtype float8_e4m3fnuz needs a ROCm build of PyTorch; use float8_e4m3fn")


def float8_blockwise_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> Tensor:
    """``torch.nn.functional.linear`` with its three GEMMs in FP8, blockwise-scaled.

    Args:
        x: ``(..., K)`` bf16/fp16/fp32 (any leading shape, flattened to rows).
        weight: ``(N, K)`` bf16/fp16/fp32.
        bias: optional ``(N,)``, added in ``x``'s dtype.
        float8_dtype: ``torch.float8_e4m3fn``, or ``torch.float8_e4m3fnuz`` (ROCm or CPU).
        round_scales_to_power_of_2: round every scale up to a power of two.

    Returns:
        ``(..., N)`` in ``x``'s dtype, differentiable in ``x``, ``weight`` and
        ``bias``; ``dx`` comes in ``x``'s dtype, ``dW`` in ``weight``'s.
    """
    _check_linear_inputs(x, weight, bias, float8_dtype)
    if not isinstance(round_scales_to_power_of_2, bool):
        raise TypeError(f"round_scales_to_power_of_2 must be a bool, got {round_scales_to_power_of_2!r}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        # No tokens: nothing to quantize (the product is empty, dW is 0).
        out = rows @ weight.t().to(x.dtype)
    else:
        out = Float8BlockwiseLinearFunction.apply(
            rows.contiguous(), weight.contiguous(), float8_dtype, round_scales_to_power_of_2
        )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], n)


class Float8BlockwiseLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs (forward, dgrad, wgrad) run in FP8 with blockwise scales.

    Same parameters, state dict and call as ``nn.Linear``; ``float8_dtype`` and
    ``round_scales_to_power_of_2`` pick the quantization.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        round_scales_to_power_of_2: bool = False,
    ) -> None:
        check_fp8_dtype(float8_dtype)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.float8_dtype = float8_dtype
        self.round_scales_to_power_of_2 = round_scales_to_power_of_2

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        round_scales_to_power_of_2: bool = False,
    ) -> Float8BlockwiseLinear:
        """A ``Float8BlockwiseLinear`` sharing ``linear``'s ``weight`` and ``bias`` (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            fp8 = cls(
                linear.in_features,
                linear.out_features,
                bias=False,
                float8_dtype=float8_dtype,
                round_scales_to_power_of_2=round_scales_to_power_of_2,
            )
        fp8.weight = linear.weight
        fp8.bias = linear.bias
        fp8.train(linear.training)
        return fp8

    def forward(self, x: Tensor) -> Tensor:
        return float8_blockwise_linear(x, self.weight, self.bias, self.float8_dtype, self.round_scales_to_power_of_2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8_dtype={self.float8_dtype}, recipe=blockwise"


def convert_to_float8_blockwise(
    model: nn.Module,
    filter_fn: FilterFn | None = None,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` modules for ``Float8BlockwiseLinear``, in place; returns ``model``.

    Parameters are shared, not copied (optimizers and state dicts keep working).
    Layers whose ``in_features`` or ``out_features`` is not a multiple of 16 stay
    as they are (their FP8 rows could not start on 16-byte boundaries, which TMA
    needs; such layers, e.g. a small router, gain little from FP8).

    Args:
        model: the model (an ``nn.Linear`` itself is converted and returned).
        filter_fn: ``filter_fn(module, fqn) -> bool`` picks the linears to swap; all when ``None``.
        float8_dtype: ``torch.float8_e4m3fn``, or ``torch.float8_e4m3fnuz`` (ROCm or CPU).
        round_scales_to_power_of_2: round every scale up to a power of two.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(module, fqn) -> bool, got {type(filter_fn).__name__}")
    check_fp8_dtype(float8_dtype)

    def convertible(module: nn.Module, fqn: str) -> bool:
        return (
            type(module) is nn.Linear
            and module.in_features % FEATURE_ALIGNMENT == 0
            and module.out_features % FEATURE_ALIGNMENT == 0
            and (filter_fn is None or filter_fn(module, fqn))
        )

    def replacement(module: nn.Module, fqn: str) -> nn.Module | None:
        if not convertible(module, fqn):
            return None
        return Float8BlockwiseLinear.from_linear(module, float8_dtype, round_scales_to_power_of_2)

    return swap_modules(model, replacement)
