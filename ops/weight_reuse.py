"""Quantized expert weights made once and reused while the weights do not change.

Kept forms (``Fp8Recipe.keep_quantized_weights``, on by default): each weight's
quantized forms are kept with the weight and made again after the next optimizer
step or when the weight changes. Every micro-batch between two optimizer steps
then reuses them, with no context manager. What counts as a change:

- any ``torch.optim.Optimizer``'s ``step()`` (a global step hook: fused optimizers
  and ``DTensor`` parameters update weights without bumping their version counters);
- the weight's version counter (``load_state_dict``, any in-place edit) or storage
  (``w.data = ...``: known by the storage itself, not its address, which a new storage may reuse).

Writes through ``w.data`` (``w.data.copy_(...)``) and optimizers that are not
``torch.optim.Optimizer`` subclasses cannot be seen: call ``release_quantized_weights()``
after them. The forms live as long as the weight (they are held in its ``__dict__``) or
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
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

T = TypeVar("T")

# (id(weight), key) -> (weight, its (version, storage) when quantized, a weak reference to that storage,
# the quantized forms). The entry holds the weight, so its id cannot be reused by another tensor while
# the block lasts, and the storage weakly, so that no other storage can take its address.
_Cache = dict[tuple[int, Hashable], tuple[Tensor, tuple[int, int], StorageWeakRef, object]]

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
    w = owning_tensor(w)  # an exact view (a new object each pass) is known by its parameter
    storage = _storage(w)
    state = (w._version, storage._cdata)
    entry = cache.get((id(w), key))
    if entry is not None:
        if entry[1] != state:
            raise RuntimeError(
                "a weight was modified in place or given new storage inside ops.reuse_quantized_weights() after "
                f"it was quantized (version, storage {entry[1]} -> {state}): step the optimizer (or change "
                "weights) outside the block. Under FSDP2, keep the weights gathered between micro-batches "
                "(reshard_after_forward=False, module.set_reshard_after_backward(False)), or gather them in FP8 "
                "(ops.enable_fp8_all_gather), whose weights are never re-quantized"
            )
        return entry[3]  # type: ignore[return-value]
    result = quantize()
    cache[(id(w), key)] = (w, state, StorageWeakRef(storage), result)
    return result


class _Kept:
    """A weight's kept forms, held in the weight's own ``__dict__`` (``_KEPT_ATTR``): they die with it,
    and ``torch.utils.swap_tensors`` (``module.to()`` of ``DTensor`` parameters, ``enable_fp8_all_gather``),
    which refuses tensors with weak references, moves them with the values they were made from.
    Also its state when they were made, and that state's storage weakly (no other storage can take
    its address while the entry lives). A copy or a pickle of the weight gets an empty entry."""

    __slots__ = ("state", "storage", "forms", "__weakref__")

    def __init__(self) -> None:
        self.state: tuple[int, int, int, int] | None = None
        self.storage: StorageWeakRef | None = None
        self.forms: dict[Hashable, object] = {}
        _kept.add(self)

    def remake(self, w: Tensor) -> None:
        """Forget the forms: they are made again from ``w`` as it is now."""
        storage = _storage(w)
        self.storage = StorageWeakRef(storage)
        self.state = _state(w, storage)
        self.forms.clear()

    def __deepcopy__(self, memo: dict) -> _Kept:
        return _Kept()

    def __copy__(self) -> _Kept:
        return _Kept()

    def __reduce__(self) -> tuple[type, tuple]:
        return (_Kept, ())


# A pickled weight carries an empty entry: loadable with torch.load(weights_only=True).
torch.serialization.add_safe_globals([_Kept])

_KEPT_ATTR = "_fp8moe_kept_forms"
# Every live entry (weakly: an entry lives as long as its weight), for ``release_quantized_weights``.
_kept: weakref.WeakSet[_Kept] = weakref.WeakSet()
# Optimizer steps taken so far (any torch.optim.Optimizer): part of every kept form's state.
_optimizer_steps = 0


def _count_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _storage(w: Tensor) -> torch.UntypedStorage:
    """``w``'s storage (a ``DTensor``'s: its local tensor's)."""
    local = getattr(w, "_local_tensor", None)  # a DTensor has no storage of its own
    return (w if local is None else local).untyped_storage()


def _state(w: Tensor, storage: torch.UntypedStorage | None = None) -> tuple[int, int, int, int]:
    """What a kept form was made from: the optimizer steps so far, ``w``'s version, its storage (the
    ``StorageImpl``'s address: unique while the entry holds a weak reference to it, which keeps a dead
    storage's address from being taken by a new one, as a reused data pointer could be) and, for a
    ``DTensor``, its local tensor (FSDP2 writes a new local tensor below autograd)."""
    storage = _storage(w) if storage is None else storage
    local = getattr(w, "_local_tensor", None)
    return (_optimizer_steps, w._version, storage._cdata, 0 if local is None else id(local))


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
    entry = w.__dict__.get(_KEPT_ATTR)
    if entry is None:
        entry = w.__dict__[_KEPT_ATTR] = _Kept()
    if entry.state != _state(w):
        entry.remake(w)
    if key in entry.forms:
        return entry.forms[key]  # type: ignore[return-value]
    result = entry.forms[key] = quantize()
    return result


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never while ``torch.compile`` traces)."""
    return not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def kept_forms(w: Tensor) -> dict[Hashable, object]:
    """The forms kept for ``w`` now (by key), empty if none, if ``w`` changed since they were made,
    while ``torch.compile`` traces or while a CUDA graph is captured."""
    if torch.compiler.is_compiling() or _capturing():
        return {}
    w = owning_tensor(w)
    entry = w.__dict__.get(_KEPT_ATTR)
    if entry is None or entry.state != _state(w):
        return {}
    return dict(entry.forms)


def release_quantized_weights() -> None:
    """Drop every kept quantized weight form (``Fp8Recipe.keep_quantized_weights``); they are made again on next use."""
    for entry in list(_kept):
        entry.forms.clear()
        entry.state = entry.storage = None
