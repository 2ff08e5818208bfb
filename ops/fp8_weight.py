"""``Fp8WeightTensor``: an expert weight that arrives already quantized, in the rowwise recipe's forward form.

FSDP2 with FP8 all-gather (``ops.fsdp``) gathers each expert weight as its FP8
values ``(E, N, K)`` and scales ``(E, N)`` (one per ``(e, n)`` over ``K``), and
hands the module this tensor in place of the bf16 parameter. It has the
parameter's shape and high-precision dtype (the dtype of its gradient), so
autograd, FSDP2 and the module treat it as the weight, while
``ops.functional`` passes its FP8 parts to the grouped linear, which skips the
weight's forward quantization: the forward GEMM reads them as they are, and
dgrad takes the folded form (the FP8 values copied transposed by
``transpose_fp8``, the forward scales folded into ``grad_out``;
``Fp8Recipe.fold_dgrad_weight_scales``), whatever the recipe's fold option.

``w.transpose(-2, -1)`` gives its transposed view ``(E, K, N)`` (torchtitan's experts hand
their GEMM seam ``B_t = w.transpose(-2, -1)``; ``ops.fp8_grouped_mm`` transposes it back)
and ``w.to(dtype)`` the same values as another high-precision dtype: both keep the FP8
parts. Any other op on it (``w + 1``, ``w.sum()``, printing) runs on the dequantized
values ``data * scales`` and returns a plain tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

# Ops that keep the tensor as it is: FSDP2 takes an as_strided view of the gathered
# tensor with its own shape and strides and makes an nn.Parameter of it (detach).
_ALIASING_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
}


class Fp8WeightTensor(Tensor):
    """An ``(E, N, K)`` expert weight held as FP8 values and one float32 scale per ``(e, n)``.

    ``dtype`` is the high-precision dtype it stands for (bf16 or fp32);
    ``quant`` the rowwise recipe's quantization options it was made with,
    ``(float8_dtype, round_scales_to_power_of_2)``.
    """

    data_fp8: Tensor
    scales: Tensor
    quant: tuple[torch.dtype, bool]

    @staticmethod
    def __new__(
        cls, data_fp8: Tensor, scales: Tensor, dtype: torch.dtype, quant: tuple[torch.dtype, bool],
        transposed: bool = False,
    ):
        e, n, k = data_fp8.shape
        shape, strides = ((e, k, n), (n * k, 1, k)) if transposed else ((e, n, k), (n * k, k, 1))
        return Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=dtype, device=data_fp8.device, requires_grad=False
        )

    def __init__(
        self, data_fp8: Tensor, scales: Tensor, dtype: torch.dtype, quant: tuple[torch.dtype, bool],
        transposed: bool = False,
    ):
        if data_fp8.dim() != 3 or tuple(scales.shape) != tuple(data_fp8.shape[:2]):
            raise ValueError(
                f"Fp8WeightTensor needs data (E, N, K) and scales (E, N), got {tuple(data_fp8.shape)} and "
                f"{tuple(scales.shape)}"
            )
        self.data_fp8 = data_fp8
        self.scales = scales
        self.quant = quant
        self.transposed = transposed

    def __repr__(self) -> str:
        return (
            f"Fp8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self.data_fp8.dtype}, "
            f"transposed={self.transposed})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple[object, ...]]:
        return ["data_fp8", "scales"], (self.dtype, self.quant, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: tuple, outer_size, outer_stride) -> Fp8WeightTensor:
        dtype, quant, transposed = meta
        return Fp8WeightTensor(inner["data_fp8"], inner["scales"], dtype, quant, transposed)

    def _like(self, dtype: torch.dtype | None = None, transposed: bool | None = None) -> Fp8WeightTensor:
        """The same FP8 values and scales, with another dtype or as the other view."""
        return Fp8WeightTensor(
            self.data_fp8, self.scales, self.dtype if dtype is None else dtype, self.quant,
            self.transposed if transposed is None else transposed,
        )

    def dequantize(self) -> Tensor:
        """The values it stands for, ``data * scales``, in its dtype (and its view: ``(E, K, N)`` if transposed)."""
        values = (self.data_fp8.to(torch.float32) * self.scales[..., None]).to(self.dtype)
        return values.transpose(1, 2) if self.transposed else values

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASING_OPS and not _restrides(func, args, kwargs):
            src = args[0]
            size = tuple(args[1]) if len(args) > 1 and func is not torch.ops.aten.detach.default else src.shape
            if tuple(size) != tuple(src.shape):
                raise NotImplementedError(f"Fp8WeightTensor: {func} to another shape {size} (has {tuple(src.shape)})")
            return src._like()
        if func is torch.ops.aten.transpose.int and {d % 3 for d in args[1:3]} == {1, 2}:
            return args[0]._like(transposed=not args[0].transposed)
        if func is torch.ops.aten._to_copy.default and _is_dtype_cast(args[0], kwargs):
            return args[0]._like(dtype=kwargs["dtype"])

        def unwrap(t: object) -> object:
            return t.dequantize() if isinstance(t, Fp8WeightTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    __torch_function__ = torch._C._disabled_torch_function_impl


def _restrides(func: object, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is an ``as_strided`` to other strides or another offset than its input's: a
    different view of the values, which the dense values then give (a same-layout alias keeps the FP8 form)."""
    if func is not torch.ops.aten.as_strided.default:
        return False
    src = args[0]
    stride = args[2] if len(args) > 2 else kwargs.get("stride")
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    return tuple(stride) != tuple(src.stride()) or offset not in (None, src.storage_offset())


def _is_dtype_cast(t: Fp8WeightTensor, kwargs: dict) -> bool:
    """Whether ``aten._to_copy(t, **kwargs)`` only changes the high-precision dtype (``w.bfloat16()``)."""
    same_place = kwargs.get("device") in (None, t.device) and kwargs.get("layout") in (None, torch.strided)
    dtype_only = set(kwargs) <= {"dtype", "device", "layout", "memory_format", "non_blocking"}
    return (
        same_place and dtype_only and kwargs.get("dtype") in (torch.bfloat16, torch.float16, torch.float32)
        and kwargs.get("memory_format") in (None, torch.preserve_format)
    )
