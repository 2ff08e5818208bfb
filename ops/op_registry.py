"""The ``fp8moe`` custom-op namespace, and the fast eager path around it.

Every kernel launcher is a PyTorch custom op so that ``torch.compile`` traces it
as one opaque node. The ops are registered with ``torch.library.Library``
directly (schema inferred from the launcher's type hints, one
``CompositeExplicitAutograd`` kernel, a fake implementation) by ``kernel_op``,
one call per op, rather than with
``torch.library.custom_op``: that wrapper checks output aliasing and disables
Dynamo around every call, which on the H200's host measured 13-55 us per call
on top of the dispatcher's own cost, paid by every call a compiled graph makes.
The ops have no autograd formula: ``ops.autograd*`` supplies it around them.

In eager mode the dispatcher still adds host time per call, which for an MoE
layer's ~10 launches can exceed the GPU time of small experts. ``kernel_op``
therefore records each op's Python function (most often the launcher itself) next to the op, and
``kernel_ops`` hands out the op itself while Dynamo traces and the plain
function otherwise: the same code, the same results, no dispatcher in eager.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

NAMESPACE = "fp8moe"

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_functions: dict[str, Callable[..., Any]] = {}


OutputsFn = Callable[..., Any]
"""A fake's body: called with the op's arguments by name (defaults filled in), returns its outputs'
fake tensors (``ops.op_helpers.empty_on``); it names the arguments it reads and takes the rest as ``**_``."""


class Fp8moeOp:
    """One ``fp8moe`` op: calling it calls ``torch.ops.fp8moe.<name>``.

    ``fn`` runs the op (the kernel launcher itself, or a thin adapter) and gives its
    schema through its type hints; ``outputs`` is its fake (see ``OutputsFn``).
    """

    def __init__(self, name: str, fn: Callable[..., Any], outputs: OutputsFn, mutates_args: Iterable[str]) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        signature = inspect.signature(fn)

        def fake(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return outputs(**bound.arguments)

        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(torch.ops.fp8moe, self.name)(*args, **kwargs)


def kernel_op(
    fn: Callable[..., Any], outputs: OutputsFn, *, name: str | None = None, mutates_args: Iterable[str] = ()
) -> Fp8moeOp:
    """Define ``fp8moe::<name>`` (default ``fn.__name__``): its schema from ``fn``'s type hints, ``fn`` as its
    kernel and its eager ``kernel_ops`` entry, ``outputs`` as its fake."""
    name = name or fn.__name__
    if name in _functions:
        raise ValueError(f"custom op fp8moe::{name} is already defined")
    _functions[name] = fn
    return Fp8moeOp(name, fn, outputs, mutates_args)


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
