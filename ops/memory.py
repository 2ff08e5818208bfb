"""How many bytes autograd keeps alive for backward: FP8 recipes against the bf16 reference."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_tensor_bytes(
    fn: Callable[..., object], *args: object, exclude: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes of the distinct storages that autograd saves while running ``fn(*args)``.

    Storages of ``exclude`` (e.g. parameters, alive anyway) are not counted, nor is
    any storage twice. Compare ``saved_tensor_bytes(fp8_fn, ...)`` with the same
    call of the bf16 reference to see what a recipe saves.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())
