"""Quantized expert weights made once and reused while the weights do not change.

Kept forms (``Fp8Recipe.keep_quantized_weights``, on by default): each weight's
quantized forms are kept with the weight and made again after the next optimizer
step or when the weight changes. Every micro-batch between two optimizer steps
then reuses them, with no context manager. What counts as a change:

- any ``torch.optim.Optimizer``'s ``step()`` (a global step hook: fused optimizers
  and ``DTensor`` parameters update weights without bumping their version counters);
- the weight's version counter (``load_state_dict``, any in-place edit) or storage
  (``w.data = ...``).

Writes through ``w.data`` (``w.data.copy_(...)``) and optimizers that are not
``torch.optim.Optimizer`` subclasses cannot be seen: call ``release_quantized_weights()``
after them. The forms live as long as the weight (the cache holds it weakly) or
until it changes; ``release_quantized_weights()`` drops them all. Memory: one byte per
element per form kept (the forward form and, for dgrad, its transposed copy). Not kept:
weights of modules managed by FSDP2 with a bf16 all-gather (re-gathered every pass;
FSDP2's FP8 all-gather keeps each rank's quantized shard instead, ``ops.fsdp``),
expert parallelism's local shards (a new view each pass), weights seen while
``torch.compile`` traces or while a CUDA graph is captured (its replays run no host code,
so the graph quantizes the weights itself), inference tensors.

The block form below is stricter: it raises on a weight changed inside it.

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
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

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


class _Kept:
    """A weight's kept forms: the weight (weakly), its state when they were made, the forms by key."""

    __slots__ = ("ref", "state", "forms")

    def __init__(self, w: Tensor, state: tuple[int, int, int]) -> None:
        # The callback holds the key, not the entry: no reference cycle, so that an entry
        # dropped from ``_kept`` frees its forms at once (not at the next garbage collection).
        self.ref = weakref.ref(w, functools.partial(_drop_kept, id(w)))
        self.state = state
        self.forms: dict[Hashable, object] = {}


def _drop_kept(key: int, ref: weakref.ref) -> None:
    """``ref``'s weight died: its id may be reused, so its entry goes (unless replaced already)."""
    entry = _kept.get(key)
    if entry is not None and entry.ref is ref:
        del _kept[key]


# id(weight) -> its kept forms (``keep_or_quantize``).
_kept: dict[int, _Kept] = {}
# Optimizer steps taken so far (any torch.optim.Optimizer): part of every kept form's state.
_optimizer_steps = 0


def _count_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _state(w: Tensor) -> tuple[int, int, int]:
    """What a kept form was made from: the optimizer steps so far, ``w``'s version and storage."""
    local = getattr(w, "_local_tensor", None)  # a DTensor has no storage of its own
    storage = id(local) if local is not None else w.data_ptr()
    return (_optimizer_steps, w._version, storage)


def owning_tensor(w: Tensor) -> Tensor:
    """``w``'s base if ``w`` is a view that covers it exactly (same dtype, shape, strides, offset), else ``w``.

    ``w.transpose(-2, -1).transpose(-2, -1)`` (``ops.fp8_grouped_mm``'s weight from
    torchtitan's ``B_t``) is then the parameter itself: a new view object each pass,
    the same values, version counter and gradient. Only a base that is a parameter
    (a leaf that requires grad) is taken: a ``DTensor``'s local shard, which
    ``to_local()`` views, is written below autograd without a version bump.
    """
    base = w._base
    if (
        base is not None
        and base.is_leaf
        and base.requires_grad
        and base.dtype == w.dtype
        and base.shape == w.shape
        and base.stride() == w.stride()
        and base.storage_offset() == w.storage_offset()
    ):
        return base
    return w


def keep_or_quantize(w: Tensor, key: Hashable, quantize: Callable[[], T], owner: Tensor | None = None) -> T:
    """``reuse_or_quantize``, and outside a block the forms kept with ``w`` until it changes (see the module docstring).

    A change (an optimizer step, ``w``'s version counter or storage) drops all its kept
    forms at once (they were made from the old values). An exact view is known by its
    base (``owning_tensor``); ``owner``: the tensor whose changes count instead of ``w``'s
    (the ``DTensor`` parameter of an FSDP2 shard).
    """
    if torch.compiler.is_compiling() or _cache is not None or w.is_inference() or _capturing():
        return reuse_or_quantize(w, key, quantize)
    w = owning_tensor(w) if owner is None else owner
    state = _state(w)
    entry = _kept.get(id(w))
    if entry is None or entry.ref() is not w:
        entry = _kept[id(w)] = _Kept(w, state)
    elif entry.state != state:
        entry.state = state
        entry.forms.clear()
    if key in entry.forms:
        return entry.forms[key]  # type: ignore[return-value]
    result = entry.forms[key] = quantize()
    return result


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never while ``torch.compile`` traces)."""
    return not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def kept_forms(w: Tensor) -> dict[Hashable, object]:
    """The forms kept for ``w`` now (by key), empty if none, if ``w`` changed since they were made,
    or while a CUDA graph is captured."""
    if _capturing():
        return {}
    w = owning_tensor(w)
    entry = _kept.get(id(w))
    if entry is None or entry.ref() is not w or entry.state != _state(w):
        return {}
    return dict(entry.forms)


def release_quantized_weights() -> None:
    """Drop every kept quantized weight form (``Fp8Recipe.keep_quantized_weights``); they are made again on next use."""
    for entry in list(_kept.values()):
        entry.forms.clear()
    _kept.clear()
