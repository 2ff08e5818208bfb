"""Quantized expert weights made once and reused while the weights do not change.

Between two optimizer steps a weight takes part in several forward and backward
passes: one per micro-batch with gradient accumulation or pipeline parallelism,
and activation checkpointing runs a layer's forward twice. Each pass would
quantize the weight again to the same FP8 values (2-9% of a layer's step at the
benchmark shapes). Inside ``with ops.reuse_quantized_weights():`` each weight's
quantized forms are made on first use and reused until the block ends (as
Transformer Engine's ``is_first_microbatch=False`` does)::

    for batch in batches:
        with ops.reuse_quantized_weights():
            for micro_batch in batch:
                loss_fn(model(micro_batch)).backward()
        optimizer.step()  # outside the block: the weights change here

Rules:

- The weights must not change inside the block. A weight is known by identity
  (the tensor object) and checked by its version counter and storage: one
  modified in place (an optimizer step, a ``copy_``) or given new storage
  (``w.data = ...``) raises ``RuntimeError`` at its next use instead of giving
  stale FP8 values. Writes through an alias that does not share the version
  counter (``w.data.add_(...)``) cannot be seen. Inference tensors (made under
  ``torch.inference_mode``) have no version counter and are quantized every time.
- Eager mode only: while ``torch.compile`` traces, weights are quantized as usual.
- FSDP2: a weight gathered again (resharded after forward or backward) is a write
  into its storage and raises; keep the weights gathered across the block's
  micro-batches. Weights gathered in FP8 (``ops.enable_fp8_all_gather``) arrive
  quantized and are never cached.
- Memory: the FP8 forms (one byte per element each, one or two forms per
  weight) stay alive until the block ends.
- The block is global, not per thread, so that the backward passes that PyTorch
  runs on its autograd device thread see it. Blocks nest; the outermost one's end
  frees the forms.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

# (id(weight), key) -> (weight, its (version, data pointer) when quantized, the quantized forms).
# The entry holds the weight, so its id cannot be reused by another tensor while the block lasts.
_Cache = dict[tuple[int, Hashable], tuple[Tensor, tuple[int, int], object]]

_lock = threading.Lock()
_cache: _Cache | None = None
_depth = 0


@contextlib.contextmanager
def reuse_quantized_weights() -> Iterator[None]:
    """Within the block, quantize each expert weight once per form and reuse it (see the module docstring)."""
    global _cache, _depth
    with _lock:
        if _depth == 0:
            _cache = {}
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _cache = None


def reuse_or_quantize(w: Tensor, key: Hashable, quantize: Callable[[], T]) -> T:
    """``quantize()``, or its result for ``(w, key)`` from earlier in the current ``reuse_quantized_weights`` block.

    ``key`` names the forms and options asked for (``quantize`` must depend only
    on ``w`` and ``key``).
    """
    if torch.compiler.is_compiling():  # first: no guard on the block's state in compiled code
        return quantize()
    cache = _cache
    if cache is None or w.is_inference():
        return quantize()
    state = (w._version, w.data_ptr())
    entry = cache.get((id(w), key))
    if entry is not None:
        if entry[1] != state:
            raise RuntimeError(
                "a weight was modified in place or given new storage inside ops.reuse_quantized_weights() after "
                f"it was quantized (version, data pointer {entry[1]} -> {state}): step the optimizer (or change "
                "weights) outside the block. Under FSDP2, keep the weights gathered between micro-batches "
                "(reshard_after_forward=False, module.set_reshard_after_backward(False)), or gather them in FP8 "
                "(ops.enable_fp8_all_gather), whose weights are never re-quantized"
            )
        return entry[2]  # type: ignore[return-value]
    result = quantize()
    cache[(id(w), key)] = (w, state, result)
    return result
