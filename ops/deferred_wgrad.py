"""The fused experts' FP8 wgrads once per optimizer step, over every micro-batch's pairs.

With ``RowwiseOptions.deferred_wgrad``, the backward of the fused experts (``ops.moe_fused``:
the up-projection's ``w1`` and ``w3``, or a packed ``w13``; ``w2`` with the combine) computes
``dx`` as usual but not the weights' gradients: it keeps what their wgrads read. For the
up-projection, the micro-batch's ``grad_gate_up`` rows (bf16), ``x``'s FP8 token rows and
scales, the pairs' tokens and the group ends; for ``w2``, the combine's output gradient
(its token rows), the pairs' tokens and routing weights, and ``h``'s FP8 rows and scales
(the forward keeps ``h`` as its FP8 rows, as ``down_wgrad_token_rows`` does).
``ops.run_deferred_wgrads(model)``, called after the last micro-batch's backward (before
gradient clipping and ``optimizer.step()``), merges them into one batch and runs each
weight's wgrad over it once, adding it to the weight's gradient.

Why: with ``wgrad_accumulation`` each micro-batch's wgrad reads and writes the whole
gradient again. With about 256 pairs an expert (DeepSeek-V3-like, 256 experts, 8192
tokens) that traffic bounds the wgrad; one GEMM over four micro-batches ran 2.28x the
four (``python -m benchmarks.wgrad_merged``) and the layer 1.76x bf16 instead of 1.30x.
With 2048 pairs an expert the merge's copies cost more than it saves (``docs/performance.md``).

The merged batch is the one a single batch of all the micro-batches' tokens makes: their
tokens one after the other, each expert's pairs in micro-batch order
(``merge_micro_batches``), quantized for the wgrad over all of them, so the result is
bitwise that batch's wgrad (``w2``'s in its token-row form, ``down_wgrad_token_rows``;
tested), not the sum of the micro-batches' separate FP8 wgrads (each rounded with its own
scales).

Where the gradient goes follows ``wgrad_accumulation``: ``"main_grad"`` into ``w.main_grad``
(fresh when ``None``), else into ``w.grad``, added inside the GEMM where ``.grad`` is a plain
contiguous tensor of the weight's dtype, stored when it is ``None``. Held until the run:
about 0.8 GB a DeepSeek-V3-like micro-batch. An ``optimizer.step()`` over a weight with a
deferred wgrad not yet run raises; ``drop_deferred_wgrads`` forgets them (a skipped step).

Deferred only where the backward accumulates into a leaf weight without gradient hooks,
with the FP8 wgrad (a bf16 wgrad, ``torch.autograd.grad``, expert parallelism's local
views and weights with hooks take the usual path; so do a pre-quantized ``w2`` and one
stored transposed); refused under FSDP2 (its reduce-scatter follows each backward) and
``torch.compile``. DDP reduces ``.grad`` in the last micro-batch's backward, before the
run: do not combine them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT
from ops.grad_accumulation import accumulates_into, grad_target, has_gradient_hooks
import ops.grouped_linear_autograd as linear_autograd
from ops.op_registry import kernel_ops
from ops.weight_reuse import owning_tensor

if TYPE_CHECKING:
    from ops.grouped_linear_autograd import QuantizedActivation, QuantOptions, RecipeKernels

# The attribute of a weight (its owning tensor) that holds its ``DeferredWgrad``.
_ATTRIBUTE = "_fp8moe_deferred_wgrad"


# How a field of a micro-batch's wgrad inputs merges (its dataclass field's metadata "rows"): one row per
# pair (placed at the pair's merged position), one per token (the micro-batches' tokens one after the
# other), a token index per pair (placed, and offset by the tokens before), or the group ends.
PAIR, TOKEN, TOKEN_INDEX, GROUP_ENDS = "pair", "token", "token index", "group ends"


def _rows(kind: str) -> dict[str, str]:
    return {"rows": kind}


@dataclass(frozen=True)
class UpProjectionWgradInputs:
    """What one micro-batch's up-projection wgrad reads (``ops.moe_fused``'s backward)."""

    grad_gate_up: Tensor = field(metadata=_rows(PAIR))  # (P, 2H), contiguous: [grad_gate | grad_up] per sorted pair
    x_data: Tensor = field(metadata=_rows(TOKEN))  # (T, D) FP8: x's token rows, quantized rowwise
    x_scales: Tensor = field(metadata=_rows(TOKEN))  # (T,) float32
    rows: Tensor = field(metadata=_rows(TOKEN_INDEX))  # (P,) int32: each pair's token
    offs: Tensor = field(metadata=_rows(GROUP_ENDS))  # (G,) int32: cumulative group ends over the pairs

    def wgrad_operands(
        self, kernels: RecipeKernels, quant: QuantOptions, wanted: list[bool]
    ) -> list[tuple[QuantizedActivation, QuantizedActivation] | None]:
        """The wgrad's ``(grad, x)`` forms for each weight (``w1``, ``w3``; or ``w13``) it is ``wanted`` for,
        as the up-projection's backward makes them (``up_projection_wgrad_forms``)."""
        goq = kernels.quantize_folded_grad_output(
            self.grad_gate_up, self.offs, quant, False, None, self.x_scales[self.rows], True
        )
        return up_projection_wgrad_forms(goq, self.x_data, self.rows, self.offs, wanted)


def up_projection_wgrad_forms(
    goq: QuantizedActivation, x_data: Tensor, rows: Tensor, offs: Tensor, wanted: list[bool]
) -> list[tuple[QuantizedActivation, QuantizedActivation] | None]:
    """The up-projection's FP8 wgrad ``(grad, x)`` forms for each weight (``w1``, ``w3``; or ``w13``) it is
    ``wanted`` for (``None`` for the others): ``grad_gate_up``'s wgrad form ``goq`` (per (group, column), each
    pair's token scale folded in) cut into the weights' columns, and ``x``'s FP8 token rows gathered by
    ``rows`` into the padded token layout, with scales 1."""
    xt = kernel_ops.transpose_to_token_groups(x_data, offs, WGRAD_GROUP_ALIGNMENT, rows)
    ones = torch.ones((offs.shape[0], xt.shape[0]), dtype=torch.float32, device=xt.device)
    xq = linear_autograd.QuantizedActivation(None, None, xt, ones, None)
    width = goq.data_t.shape[0] // len(wanted)
    forms: list[tuple[QuantizedActivation, QuantizedActivation] | None] = []
    for i, want in enumerate(wanted):
        if not want:
            forms.append(None)
            continue
        part = slice(i * width, (i + 1) * width)
        scales = goq.scales_t[:, part].contiguous()
        forms.append((linear_autograd.QuantizedActivation(None, None, goq.data_t[part], scales, None), xq))
    return forms


@dataclass(frozen=True)
class DownProjectionWgradInputs:
    """What one micro-batch's down-projection (``w2``) wgrad reads (``ops.MoE``'s combine backward)."""

    grad: Tensor = field(metadata=_rows(TOKEN))  # (T, D), contiguous: the combine's output gradient per token
    pair_tokens: Tensor = field(metadata=_rows(TOKEN_INDEX))  # (P,): each sorted pair's token
    pair_weights: Tensor = field(metadata=_rows(PAIR))  # (P,) float32: each pair's routing weight
    h_data: Tensor = field(metadata=_rows(PAIR))  # (P, H) FP8: h's rows, quantized rowwise
    h_scales: Tensor = field(metadata=_rows(PAIR))  # (P,) float32
    offs: Tensor = field(metadata=_rows(GROUP_ENDS))

    def wgrad_operands(
        self, kernels: RecipeKernels, quant: QuantOptions, wanted: list[bool]
    ) -> list[tuple[QuantizedActivation, QuantizedActivation] | None]:
        """The wgrad's ``(grad, h)`` forms for ``w2`` (the one weight) on token rows
        (``RowwiseOptions.down_wgrad_token_rows``): the gradient's token rows quantized rowwise and gathered
        into the padded token layout, ``h``'s FP8 rows times each pair's weight and scales quantized per
        (group, column)."""
        pairs = (self.pair_tokens, self.pair_weights)
        grad_rows = kernels.quantize_token_grad_output(self.grad, pairs, self.offs, quant, None, False)
        h = linear_autograd.QuantizedActivation(self.h_data, self.h_scales, None, None, None)
        return [kernels.token_rows_wgrad_operands(grad_rows, pairs, h, self.offs, quant)]


WgradInputs = UpProjectionWgradInputs | DownProjectionWgradInputs


@dataclass(eq=False)
class DeferredWgrad:
    """The deferred wgrads of one set of weights (``(w1, w3)``, ``(w13,)`` or ``(w2,)``): each micro-batch's inputs."""

    weights: tuple[Tensor, ...]  # the owning tensors (parameters)
    wanted: list[bool]  # which of them get a gradient
    kernels: RecipeKernels
    quant: QuantOptions
    target: str  # RowwiseOptions.wgrad_accumulation
    inputs: list[WgradInputs] = field(default_factory=list)


# Every DeferredWgrad with inputs not yet run: the optimizer-step hook looks here.
_pending: weakref.WeakSet[DeferredWgrad] = weakref.WeakSet()
_hook_handle: object | None = None


def check_deferred_weight(w: Tensor) -> None:
    """Raise before any kernel runs if the deferred wgrad cannot apply to ``w`` (``torch.compile``)."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "deferred_wgrad keeps each micro-batch's wgrad inputs on the weight for ops.run_deferred_wgrads, "
            "which torch.compile cannot trace; use deferred_wgrad=False in compiled models"
        )


def defers(w: Tensor) -> bool:
    """Whether the running backward defers ``w``'s wgrad: it accumulates into ``w``, a leaf parameter without
    gradient hooks (see the module docstring)."""
    owner = owning_tensor(w)
    return owner.is_leaf and owner.requires_grad and not has_gradient_hooks(owner) and accumulates_into(owner)


def defer_wgrad(
    weights: tuple[Tensor, ...],
    wanted: list[bool],
    kernels: RecipeKernels,
    quant: QuantOptions,
    target: str,
    inputs: WgradInputs,
) -> None:
    """Keep one micro-batch's wgrad inputs for ``weights`` until ``run_deferred_wgrads``."""
    owners = tuple(owning_tensor(w) for w in weights)
    deferred = getattr(owners[0], _ATTRIBUTE, None)
    if deferred is None or len(deferred.weights) != len(owners) or any(
        a is not b for a, b in zip(deferred.weights, owners)
    ):
        deferred = DeferredWgrad(owners, list(wanted), kernels, quant, target)
        for owner in owners:
            setattr(owner, _ATTRIBUTE, deferred)
    else:
        deferred.wanted = [a or b for a, b in zip(deferred.wanted, wanted)]
    deferred.inputs.append(inputs)
    _pending.add(deferred)
    _install_step_hook()


def _deferred_in(params: Iterable[Tensor]) -> list[DeferredWgrad]:
    found: dict[int, DeferredWgrad] = {}
    for p in params:
        deferred = getattr(p, _ATTRIBUTE, None)
        if deferred is not None and deferred.inputs:
            found[id(deferred)] = deferred
    return list(found.values())


def _parameters(module: nn.Module | Iterable[Tensor]) -> Iterable[Tensor]:
    return module.parameters() if isinstance(module, nn.Module) else module


def run_deferred_wgrads(module: nn.Module | Iterable[Tensor]) -> None:
    """Run the deferred wgrads of ``module``'s parameters (or of the given tensors), each over all its micro-batches,
    adding them to the weights' gradients (see the module docstring). Nothing deferred: nothing runs."""
    for deferred in _deferred_in(_parameters(module)):
        inputs, deferred.inputs = deferred.inputs, []
        _pending.discard(deferred)
        _run(deferred, inputs)


def drop_deferred_wgrads(module: nn.Module | Iterable[Tensor]) -> None:
    """Forget the deferred wgrads of ``module``'s parameters (or of the given tensors) without running them."""
    for deferred in _deferred_in(_parameters(module)):
        deferred.inputs = []
        _pending.discard(deferred)


def has_deferred_wgrads(module: nn.Module | Iterable[Tensor]) -> bool:
    """Whether any parameter of ``module`` (or any given tensor) has a deferred wgrad not yet run."""
    return bool(_deferred_in(_parameters(module)))


def _refuse_step_with_deferred(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if not _pending:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _deferred_in(params):
        raise RuntimeError(
            "optimizer.step() over expert weights whose deferred wgrads have not run (RowwiseOptions.deferred_wgrad): "
            "call ops.run_deferred_wgrads(model) after the last micro-batch's backward (before clipping gradients), "
            "or ops.drop_deferred_wgrads(model) to skip them"
        )


def _install_step_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_refuse_step_with_deferred)


def merge_micro_batches(inputs: list[WgradInputs]) -> WgradInputs:
    """The micro-batches as one batch: their tokens one after the other, each expert's pairs in micro-batch order.

    Pair ``p`` of micro-batch ``i`` in group ``g`` goes to ``start[g] + (g's pairs in micro-batches before i) +
    (p - offs_i[g-1])``; pairs past ``offs_i[-1]`` go past every group, in micro-batch order. On the device, no sync;
    the group ends must be non-decreasing (as ``ops.sort_by_expert`` makes them).
    """
    if len(inputs) == 1:
        return inputs[0]
    first = inputs[0]
    kinds = {f.name: f.metadata["rows"] for f in fields(first)}
    ends = torch.stack([i.offs.long() for i in inputs])  # (S, G)
    device, num_groups = ends.device, ends.shape[1]
    pair_counts = [getattr(i, next(n for n, k in kinds.items() if k == TOKEN_INDEX)).numel() for i in inputs]
    sizes = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
    offs = sizes.sum(0).cumsum(0)
    earlier = sizes.cumsum(0) - sizes  # (S, G): each group's pairs in the micro-batches before
    group_start = offs - sizes.sum(0)
    # Pairs past every group in the micro-batches before: their pairs (host ints) less their routed pairs.
    routed_earlier = ends[:, -1].cumsum(0) - ends[:, -1]
    merged: dict[str, Tensor] = {}
    for name, kind in kinds.items():
        if kind in (PAIR, TOKEN_INDEX):
            like = getattr(first, name)
            merged[name] = torch.empty((sum(pair_counts), *like.shape[1:]), dtype=like.dtype, device=device)
        elif kind == TOKEN:
            merged[name] = torch.cat([getattr(i, name) for i in inputs])
    tokens_before = 0
    for s, part in enumerate(inputs):
        pair = torch.arange(pair_counts[s], device=device)
        group = torch.searchsorted(ends[s], pair, right=True)
        g = group.clamp(max=num_groups - 1)
        routed_dest = group_start[g] + earlier[s, g] + pair - (ends[s, g] - sizes[s, g])
        unrouted_dest = offs[-1] + (sum(pair_counts[:s]) - routed_earlier[s]) + pair - ends[s, -1]
        dest = torch.where(group < num_groups, routed_dest, unrouted_dest)
        for name, kind in kinds.items():
            if kind == PAIR:
                _place_rows(merged[name], dest, getattr(part, name))
            elif kind == TOKEN_INDEX:
                merged[name].index_copy_(0, dest, getattr(part, name) + tokens_before)
        tokens_before += getattr(part, next(n for n, k in kinds.items() if k == TOKEN)).shape[0]
    merged["offs"] = offs.to(first.offs.dtype)
    return type(first)(**merged)


def _place_rows(out: Tensor, dest: Tensor, rows: Tensor) -> None:
    """``out[dest] = rows``; FP8 rows as their bytes (index_copy has no FP8 kernels)."""
    if out.dtype.is_floating_point and out.dtype.itemsize == 1:
        out, rows = out.view(torch.uint8), rows.view(torch.uint8)
    out.index_copy_(0, dest, rows)


def _run(deferred: DeferredWgrad, inputs: list[WgradInputs]) -> None:
    batch = merge_micro_batches(inputs)
    forms = batch.wgrad_operands(deferred.kernels, deferred.quant, deferred.wanted)
    for w, form in zip(deferred.weights, forms):
        if form is not None:
            _add_into_gradient(w, deferred.target, deferred.kernels, *form, batch.offs)


def _add_into_gradient(
    w: Tensor, target: str, kernels: RecipeKernels, grad: QuantizedActivation, x: QuantizedActivation, offs: Tensor
) -> None:
    """The wgrad of ``(grad, x)`` added to ``w``'s gradient for ``target`` (``RowwiseOptions.wgrad_accumulation``)."""
    if target == "main_grad":
        main = getattr(w, "main_grad", None)
        if main is None:
            w.main_grad = kernels.grouped_mm_wgrad(grad, x, offs, torch.float32)
        else:
            kernels.grouped_mm_wgrad_accumulate(grad, x, offs, main)
        return
    out = grad_target(w)
    if out is not None:
        kernels.grouped_mm_wgrad_accumulate(grad, x, offs, out)
        return
    dw = kernels.grouped_mm_wgrad(grad, x, offs, w.dtype)
    with torch.no_grad():
        if w.grad is None:
            w.grad = dw
        else:
            w.grad += dw
