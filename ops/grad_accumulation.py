"""Weight gradients added into their target by the wgrad GEMM's epilogue (gradient-accumulation fusion).

With ``RowwiseOptions.wgrad_accumulation`` other than ``"off"``, an expert weight's
wgrad GEMM (the FP8 one, or the bf16 one of ``Fp8Recipe.wgrad_precision``) adds its
result into the weight's accumulated gradient in place,
and autograd gets no gradient for that weight, so its separate add pass over
every expert weight (``grad += dW``, once per micro-batch) disappears:

- ``"grad"``: into ``w.grad`` in the weight's dtype (the fp32 sum of the GEMM's
  result and the old gradient, rounded once). While ``w.grad`` is ``None`` (the first
  micro-batch after ``zero_grad()`` with ``set_to_none``) the gradient is returned to
  autograd as usual, which stores it. ``zero_grad(set_to_none=False)`` leaves zeros,
  which the next micro-batch adds to. Weights that are not leaves (expert
  parallelism's local view of a ``DTensor``, a cast of a parameter; a view that
  covers a parameter exactly counts as the parameter) and gradients
  that are not plain contiguous tensors of the weight's dtype take autograd's
  add, as without the option. Under FSDP2 the unsharded weight's ``.grad`` is the
  target between reduce-scatters (``set_requires_gradient_sync(False)``), else
  it is ``None`` each time and the gradient goes to FSDP2 as usual.
- ``"main_grad"``: into ``w.main_grad``, an fp32 tensor of the weight's shape kept
  on the parameter (Megatron-LM's form: more accurate over many micro-batches);
  ``w.grad`` stays ``None``. While ``w.main_grad`` is ``None`` or absent, the first
  micro-batch writes it fresh (no zero-fill pass). ``zero_main_grads(model)``
  zeroes or drops them; the optimizer reads ``main_grad`` (e.g. ``p.grad =
  p.main_grad.to(p.dtype)``, or fp32 master weights). Needs leaf weights: expert
  parallelism's local views, FSDP2-managed modules and FP8-gathered weights are
  refused with an error in the forward pass, before any kernel runs.

Only a backward pass that accumulates into the weight's gradient adds in place: under
``torch.autograd.grad``, or ``.backward(inputs=...)`` without the weight, the gradient goes to
autograd as without the option, and ``.grad`` / ``main_grad`` stay as they are. A weight with
gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``) takes autograd's add
with ``"grad"``, so that its hooks see every micro-batch's gradient; ``"main_grad"`` refuses it.
Under DDP ``"grad"`` works: autograd still runs the weight's gradient-accumulation node (with no
gradient) after an in-place add, so the reducer's hook on that node fires and reduces ``.grad``,
the micro-batches' sum (tested against ``"off"``, ``no_sync`` micro-batches then a synced one);
``"main_grad"`` does not (DDP reduces ``.grad``). Eager mode only: under ``torch.compile`` the
option raises (a traced backward cannot add into ``.grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ops.weight_reuse import owning_tensor

WGRAD_ACCUMULATION_TARGETS = ("off", "grad", "main_grad")

# (out to add into or None, dtype of a fresh result) -> the weight gradient (``out`` when given).
WgradGemm = Callable[[Tensor | None, torch.dtype], Tensor]


def check_wgrad_accumulation(value: object, name: str = "wgrad_accumulation") -> str:
    """``value`` if it is one of ``WGRAD_ACCUMULATION_TARGETS``, else a ``ValueError`` naming ``name``."""
    if not isinstance(value, str) or value not in WGRAD_ACCUMULATION_TARGETS:
        raise ValueError(f"{name} must be one of {list(WGRAD_ACCUMULATION_TARGETS)}, got {value!r}")
    return value


def check_accumulation_weight(w: Tensor, target: str) -> None:
    """Raise before any kernel runs if ``w`` cannot take ``target`` (see the module docstring)."""
    if target == "off":
        return
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"wgrad_accumulation={target!r} adds into the weight's gradient inside backward, which "
            "torch.compile cannot trace; use wgrad_accumulation='off' in compiled models"
        )
    if target != "main_grad":
        return
    w = owning_tensor(w)
    if has_gradient_hooks(w):
        raise ValueError(
            "wgrad_accumulation='main_grad' adds the weight gradient into main_grad, past the hooks registered on "
            "the weight (register_hook, register_post_accumulate_grad_hook), which would not run: use 'grad' "
            "(the hooks then see every micro-batch's gradient) or 'off'"
        )
    if not w.is_leaf or not w.requires_grad or type(w) not in (Tensor, nn.Parameter):
        raise ValueError(
            "wgrad_accumulation='main_grad' needs each expert weight to be a plain leaf parameter (its main_grad "
            f"lives on it); got a {type(w).__name__}{'' if w.is_leaf else ' that is not a leaf'} "
            "(expert parallelism's local view, FSDP2's gathered weight, a cast): use 'grad' or 'off' there"
        )
    main = getattr(w, "main_grad", None)
    if main is not None and (
        not isinstance(main, Tensor)
        or main.dtype != torch.float32
        or main.shape != w.shape
        or main.device != w.device
        or not main.is_contiguous()
    ):
        raise ValueError(
            f"a weight's main_grad must be a contiguous float32 tensor of the weight's shape {tuple(w.shape)} on "
            f"{w.device}, got {type(main).__name__} "
            f"{getattr(main, 'dtype', '')} {tuple(getattr(main, 'shape', ()))} on {getattr(main, 'device', '')}"
        )


def has_gradient_hooks(w: Tensor) -> bool:
    """Whether hooks see ``w``'s gradient on its way into ``.grad``: ``w.register_hook`` or
    ``w.register_post_accumulate_grad_hook``."""
    return bool(w._backward_hooks) or bool(getattr(w, "_post_accumulate_grad_hooks", None))


def grad_target(w: Tensor) -> Tensor | None:
    """``w.grad`` (``w`` its ``owning_tensor``) if the GEMM can add into it in place, else ``None`` (autograd then adds)."""
    if not w.is_leaf or not w.requires_grad:
        return None
    grad = w.grad
    if (
        grad is None
        or type(grad) is not Tensor
        or grad.dtype != w.dtype
        or grad.shape != w.shape
        or grad.requires_grad
        or not grad.is_contiguous()
    ):
        return None
    return grad


def accumulates_into(w: Tensor) -> bool:
    """Whether the running backward pass accumulates into leaf ``w``'s gradient: ``.backward()`` with
    ``w`` among its inputs (all leaves without ``inputs=``). Not ``torch.autograd.grad``, which returns
    the gradients it is asked for and accumulates none, nor ``.backward(inputs=...)`` without ``w``."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(w).node)
    except RuntimeError:  # raised for a leaf while torch.autograd.grad runs: nothing is accumulated
        return False


def accumulate_wgrad(w: Tensor, target: str, gemm: WgradGemm) -> Tensor | None:
    """Run ``gemm`` for weight ``w`` with ``target``; returns the gradient autograd should get (``None``: added in place).

    Only a backward pass that accumulates into ``w``'s gradient adds in place; under
    ``torch.autograd.grad`` or ``.backward(inputs=...)`` without ``w`` the gradient goes to autograd,
    which returns or drops it, and ``.grad`` / ``main_grad`` stay as they are."""
    owner = owning_tensor(w)
    if target != "off" and owner.is_leaf and owner.requires_grad and not accumulates_into(owner):
        return gemm(None, w.dtype)
    if target == "grad" and has_gradient_hooks(owner):
        return gemm(None, w.dtype)  # the hooks see every micro-batch's gradient, as without the option
    if target == "grad":
        out = grad_target(owner)
        if out is None:
            return gemm(None, w.dtype)
        gemm(out, out.dtype)
        return None
    if target == "main_grad":
        main = getattr(owner, "main_grad", None)
        if main is None:
            owner.main_grad = gemm(None, torch.float32)
        else:
            gemm(main, main.dtype)
        return None
    return gemm(None, w.dtype)


def zero_main_grads(module: nn.Module | Iterable[Tensor], set_to_none: bool = True) -> None:
    """Drop (``set_to_none``) or zero the ``main_grad`` of every parameter of ``module`` (or of the given tensors)."""
    params = module.parameters() if isinstance(module, nn.Module) else module
    for p in params:
        if getattr(p, "main_grad", None) is None:
            continue
        if set_to_none:
            p.main_grad = None
        else:
            p.main_grad.zero_()
