"""The ``fp8moe`` custom-op namespace, and the fast eager path around it.

Every kernel launcher is a ``torch.library`` custom op so that ``torch.compile``
traces it as one opaque node. In eager mode the dispatcher adds about 60-120 us
of host time per call (schema binding, aliasing checks, autograd key), which
for an MoE layer's ~10 launches is more than the GPU time of small experts.
``fp8moe_op`` therefore records each op's Python function next to the op, and
``kernel_ops`` hands out the op itself while Dynamo traces and the plain
function otherwise: the same code, the same results, no dispatcher in eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

NAMESPACE = "fp8moe"

_functions: dict[str, Callable[..., Any]] = {}


def fp8moe_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op(f"fp8moe::{name}")`` that also registers ``fn`` for eager calls."""

    def decorator(fn: Callable[..., Any]) -> Any:
        if name in _functions:
            raise ValueError(f"custom op fp8moe::{name} is already defined")
        _functions[name] = fn
        return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))(fn)

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
