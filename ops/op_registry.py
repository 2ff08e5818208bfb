"""The ``fp8moe`` custom-op namespace, and the fast eager path around it.

Every kernel launcher is a PyTorch custom op so that ``torch.compile`` traces it
as one opaque node. The ops are registered with ``torch.library.Library``
directly (schema inferred from the launcher's type hints, one
``CompositeExplicitAutograd`` kernel, a fake implementation) rather than with
``torch.library.custom_op``: that wrapper checks output aliasing and disables
Dynamo around every call, which on the H200's host measured 13-55 us per call
on top of the dispatcher's own cost, paid by every call a compiled graph makes.
The ops have no autograd formula: ``ops.autograd*`` supplies it around them.

In eager mode the dispatcher still adds host time per call, which for an MoE
layer's ~10 launches can exceed the GPU time of small experts. ``fp8moe_op``
therefore records each op's Python function next to the op, and
``kernel_ops`` hands out the op itself while Dynamo traces and the plain
function otherwise: the same code, the same results, no dispatcher in eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

NAMESPACE = "fp8moe"

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_functions: dict[str, Callable[..., Any]] = {}


class Fp8moeOp:
    """One ``fp8moe`` op: calling it calls ``torch.ops.fp8moe.<name>``; ``register_fake`` adds its fake."""

    def __init__(self, name: str, fn: Callable[..., Any], mutates_args: Iterable[str]) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(torch.ops.fp8moe, self.name)(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the op's output shapes, dtypes and strides for ``torch.compile`` (``torch.library.register_fake``)."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def fp8moe_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Fp8moeOp]:
    """Define ``fp8moe::{name}`` from ``fn`` (schema from its type hints) and register ``fn`` for eager calls."""

    def decorator(fn: Callable[..., Any]) -> Fp8moeOp:
        if name in _functions:
            raise ValueError(f"custom op fp8moe::{name} is already defined")
        _functions[name] = fn
        return Fp8moeOp(name, fn, mutates_args)

    return decorator


class _KernelOps:
    """``kernel_ops.<name>``: ``torch.ops.fp8moe.<name>`` under ``torch.compile``, its function in eager."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if torch.compiler.is_compiling():
            return getattr(torch.ops.fp8moe, name)
        try:
            return _functions[name]
        except KeyError:
            raise AttributeError(f"no fp8moe custom op named {name!r}") from None


kernel_ops = _KernelOps()
