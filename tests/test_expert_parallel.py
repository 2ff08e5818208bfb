"""Expert parallelism against a single-process run of the same layer; FP8 dispatch; the host-sync count; bad input.

Each distributed test spawns one process group (gloo on the CPU, NCCL on GPUs) and
runs every case in it: the EP layer on each rank's tokens against the same layer
with all experts in one process on all ranks' tokens (every rank computes it), its
experts handing the pairs' rows to the layer's combine as they do under expert
parallelism (``_CombineAfterExperts``).
Forward outputs and input gradients must be bitwise equal, weight gradients equal
up to summation order. On GPUs the single-process run's larger GEMMs may get other
kernel configurations (tile sizes, hence the order of the fp32 sums) than each rank's,
so there the comparison with it is by SQNR (and whether it is bitwise is printed);
the comparisons within one rank (FP8 vs bf16 dispatch, quantization before vs after
the exchange) are bitwise everywhere.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor

import ops
from ops.op_registry import kernel_ops
from tests.support import assert_fp8_equal, gloo_cpu_only, run_distributed, sqnr_db


@dataclass(frozen=True)
class Shape:
    dim: int
    hidden: int
    experts_per_rank: int
    top_k: int
    tokens: int  # per rank (some cases vary it)


CPU_SHAPE = Shape(dim=32, hidden=32, experts_per_rank=2, top_k=2, tokens=6)
GPU_SHAPE = Shape(dim=2048, hidden=768, experts_per_rank=8, top_k=8, tokens=4096)
# (experts, fp8_dispatch, cases): FP8 backward is slow in Triton's CPU interpreter, so not every pair runs
# on the CPU: world size 3 leaves out FP8 experts with bf16 dispatch (world size 2 compares both dispatches).
ALL_RUNS = (("bf16", False, ("edge", "router")), ("fp8", False, ("edge",)), ("fp8", True, ("edge", "router")))
CPU_RUNS_3 = (ALL_RUNS[0], ALL_RUNS[2])


def _layer(shape: Shape, world: int, fp8: bool, device: torch.device) -> ops.MoE:
    torch.manual_seed(0)
    moe = ops.MoE(shape.dim, shape.hidden, shape.experts_per_rank * world, shape.top_k, device=device)
    # Larger router weights than nn.Linear's default: routing then differs between tokens.
    nn.init.normal_(moe.router.weight, std=1.0)
    return ops.convert_to_fp8(moe) if fp8 else moe


class _CombineAfterExperts(ops.Fp8GroupedExperts):
    """FP8 experts whose rows ``ops.MoE`` combines after them (``combine_pairs``), as under expert parallelism,
    where the combine follows the rows' return: on one process the fused experts would take the combine
    (``down_projection_combine`` with SwiGLU's backward in ``w2``'s), another rounding of the same math."""

    takes_combine = False


def _cases(shape: Shape, world: int, device: torch.device) -> dict[str, list[tuple]]:
    """Per case, every rank's ``(x, top_probs, top_experts, grad_out)`` (``None`` routing: the router's)."""
    num_experts = shape.experts_per_rank * world
    gen = torch.Generator().manual_seed(1)

    def inputs(tokens: int, low: int, high: int, routed: bool, repeat_first: bool) -> tuple:
        x = torch.randn(tokens, shape.dim, generator=gen).to(torch.bfloat16)
        grad = torch.randn(tokens, shape.dim, generator=gen).to(torch.bfloat16)
        if not routed:
            return x.to(device), None, None, grad.to(device)
        experts = torch.randint(low, high, (tokens, shape.top_k), generator=gen)
        experts[experts == 1] = 0  # expert 1 gets no tokens
        if repeat_first and tokens:
            experts[0, :] = experts[0, 0]  # the same expert twice in one token's choices
        probs = torch.rand(tokens, shape.top_k, generator=gen) + 0.1
        return x.to(device), probs.to(device), experts.to(device), grad.to(device)

    local = shape.experts_per_rank
    return {
        # Rank 0 has no tokens (sends nothing); no token goes to the last rank's experts (it receives
        # nothing); expert 1 gets no tokens; each rank's first token chooses one expert top_k times;
        # uneven token counts.
        "edge": [
            inputs(0 if r == 0 else shape.tokens + 3 * r, 0, num_experts - local, True, True) for r in range(world)
        ],
        # The router's own top-k.
        "router": [inputs(shape.tokens + r, 0, 0, False, False) for r in range(world)],
    }


def _run(moe: ops.MoE, x, probs, experts, grad, checkpointed: bool = False) -> dict[str, torch.Tensor]:
    """One forward and backward; with ``checkpointed``, under activation checkpointing (the forward
    recomputed in backward)."""
    x = x.clone().requires_grad_()
    if probs is None:
        out = moe(x)
    else:
        probs = probs.clone().requires_grad_()
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(moe.apply_experts, x, probs, experts, use_reentrant=False)
        else:
            out = moe.apply_experts(x, probs, experts)
    out.backward(grad)
    result = {"out": out.detach(), "dx": x.grad}
    if probs is not None:
        result["dprobs"] = probs.grad
    for name in ("w1", "w2", "w3"):
        g = getattr(moe.experts, name).grad
        result[name] = g.to_local() if isinstance(g, DTensor) else g
    result["router"] = moe.router.weight.grad
    moe.zero_grad(set_to_none=True)
    return result


def _check_equal(actual: torch.Tensor, expected: torch.Tensor, label: str, exact: bool) -> None:
    """Bitwise equal if ``exact``, else at least 40 dB SQNR (and says whether it is bitwise)."""
    if exact:
        assert torch.equal(actual, expected), f"{label} differs"
        return
    bitwise = torch.equal(actual, expected)
    if not bitwise:
        assert actual.numel() == 0 or sqnr_db(actual, expected) >= 40, f"{label}: SQNR {sqnr_db(actual, expected):.1f} dB"
    print(f"{label}: {'bitwise equal' if bitwise else f'SQNR {sqnr_db(actual, expected):.1f} dB'}", flush=True)


def _check_close(
    actual: torch.Tensor, expected: torch.Tensor, label: str, device: torch.device, atol: float = 1e-3
) -> None:
    """Equal up to summation order: elementwise on the CPU; by SQNR on GPUs, where an input that
    differs in its last bit (see the module docstring) may round one FP8 element the other way."""
    if device.type == "cpu":
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=atol, msg=lambda m: f"{label}: {m}")
    else:
        assert sqnr_db(actual, expected) >= 30, f"{label}: SQNR {sqnr_db(actual, expected):.1f} dB"


def _runs(world: int, device: torch.device) -> tuple:
    return CPU_RUNS_3 if device.type == "cpu" and world == 3 else ALL_RUNS


def _references(rank: int, world: int, shape: Shape, device: torch.device, cases: dict) -> dict:
    """The single-process run of every (experts, case) that ``RUNS`` needs: computed on rank 0, broadcast."""
    references = {}
    if rank == 0:
        runs = _runs(world, device)
        for experts_kind in {kind for kind, _, _ in runs}:
            layer = _layer(shape, world, experts_kind == "fp8", device)
            if experts_kind == "fp8":
                layer.experts.__class__ = _CombineAfterExperts
            for case in {c for kind, _, names in runs if kind == experts_kind for c in names}:
                inputs = cases[case]
                joined = [None if inputs[0][i] is None else torch.cat([inp[i] for inp in inputs]) for i in range(4)]
                result = _run(layer, *joined)
                references[experts_kind, case] = {k: None if v is None else v.cpu() for k, v in result.items()}
    box = [references]
    dist.broadcast_object_list(box, src=0)
    return {key: {k: None if v is None else v.to(device) for k, v in r.items()} for key, r in box[0].items()}


def _check_against_reference(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    cases = _cases(shape, world, device)
    references = _references(rank, world, shape, device, cases)
    local = shape.experts_per_rank
    experts_slice = slice(rank * local, (rank + 1) * local)
    first_dispatch = {}
    for experts_kind, fp8_dispatch, case_names in _runs(world, device):
        layer = _layer(shape, world, experts_kind == "fp8", device)
        ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=fp8_dispatch)
        assert isinstance(layer.experts.w1, DTensor) and layer.experts.w1.to_local().shape[0] == local
        for case in case_names:
            label = f"{case}, {experts_kind} experts, {'fp8' if fp8_dispatch else 'bf16'} dispatch, rank {rank}"
            inputs = cases[case]
            rows = [0] + torch.tensor([x.shape[0] for x, *_ in inputs]).cumsum(0).tolist()
            mine = slice(rows[rank], rows[rank + 1])
            reference = references[experts_kind, case]
            result = _run(layer, *inputs[rank])
            for name in ("out", "dx", "dprobs"):
                if name in result:
                    _check_equal(result[name], reference[name][mine], f"{name} ({label})", exact=device.type == "cpu")
            for name in ("w1", "w2", "w3"):
                _check_close(result[name], reference[name][experts_slice], f"{name} ({label})", device)
            if result["router"] is not None:  # the router's own routing (the same case on every rank)
                router_grad = result["router"].clone()
                dist.all_reduce(router_grad)
                _check_close(router_grad, reference["router"], f"router ({label})", device, atol=1e-2)
            # FP8 experts read the same FP8 rows with either dispatch: their weight gradients are bitwise equal too.
            if (experts_kind, case) in first_dispatch:
                for name in ("w1", "w2", "w3"):
                    assert torch.equal(result[name], first_dispatch[experts_kind, case][name]), f"{name}: dispatches ({label})"
            first_dispatch[experts_kind, case] = result


def _check_fp8_dispatch_matches_quantize_after(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    """Quantizing rows before the exchange gives the bitwise FP8 rows and scales of quantizing them after it."""
    layer = _layer(shape, world, True, device)
    recipe = layer.experts.recipe
    num_experts = shape.experts_per_rank * world
    bf16 = ops.ExpertParallel(dist.group.WORLD, num_experts)
    fp8 = ops.ExpertParallel(dist.group.WORLD, num_experts, fp8_dispatch=True, recipe=recipe)
    x, probs, experts, _ = _cases(shape, world, device)["router"][rank]
    probs, experts = layer.route(x)
    order = ops.sort_by_expert(experts, num_experts)
    # Rows of very different magnitudes: each row's scale differs.
    x_sorted = (x.float()[order.order // shape.top_k] * torch.logspace(-3, 3, order.order.numel(), device=device)[:, None]).to(x.dtype)
    received, counts, none, _ = bf16.dispatch(x_sorted, order.num_tokens_per_expert)
    anchor, counts_fp8, (data, scales), _ = fp8.dispatch(x_sorted, order.num_tokens_per_expert)
    assert none is None and torch.equal(counts, counts_fp8) and anchor.shape == received.shape
    data_after, scales_after = kernel_ops.quantize_rowwise_rows(received, recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    assert_fp8_equal(data, data_after)
    assert torch.equal(scales, scales_after)
    # Token rows read by index (ops.MoE's call): each token quantized once, the same FP8 rows.
    from ops.ep_layout import TokenRows

    tokens = TokenRows(order.order // shape.top_k, order.inverse.view(-1, shape.top_k))
    _, _, (data_sorted, scales_sorted), _ = fp8.dispatch(x[tokens.token], order.num_tokens_per_expert)
    _, counts_tokens, (data_tokens, scales_tokens), _ = fp8.dispatch(x, order.num_tokens_per_expert, tokens)
    assert torch.equal(counts_tokens, counts)
    assert_fp8_equal(data_tokens, data_sorted)
    assert torch.equal(scales_tokens, scales_sorted)


def _expect_error(exc: type, match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _check_bad_input(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    num_experts = shape.experts_per_rank * world
    # Routing outside [0, E) on one rank only: every rank raises, after the counts' exchange, before the rows'.
    layer = _layer(shape, world, False, device)
    ops.apply_expert_parallel(layer, dist.group.WORLD)
    x, probs, experts, _ = _cases(shape, world, device)["edge"][rank]
    if rank == world - 1:
        experts = experts.clone()
        experts[0, 0] = num_experts
    _expect_error(ValueError, rf"EP ranks \[{world - 1}\]", layer.apply_experts, x, probs, experts)
    # The layer still works afterwards (no collective was left half-done).
    x, probs, experts, _ = _cases(shape, world, device)["edge"][rank]
    layer.apply_experts(x, probs, experts)
    # Negative counts on one rank that still add up to its rows: every rank raises, no index out of bounds.
    counts = torch.ones(num_experts, dtype=torch.int64, device=device)
    if rank == 0:
        counts[0], counts[1] = -1, 3
    rows = torch.randn(num_experts, shape.dim, device=device).to(torch.bfloat16)
    _expect_error(ValueError, r"negative counts\) on EP ranks \[0\]", layer.experts, rows, counts)
    # Counts of the wrong length: local, before any collective.
    _expect_error(ValueError, "num_tokens_per_expert must have shape", layer.experts, x, torch.zeros(3, dtype=torch.int64, device=device))
    # Applied twice.
    _expect_error(ValueError, "already has expert parallelism", ops.apply_expert_parallel, layer, dist.group.WORLD)
    # E not divisible by the EP size (same on every rank).
    odd = ops.MoE(shape.dim, shape.hidden, world + 1, 1, device=device)
    _expect_error(ValueError, "divisible by the EP size", ops.apply_expert_parallel, odd, dist.group.WORLD)
    # Expert counts that differ across ranks: the set-up check raises on every rank.
    mismatched = ops.MoE(shape.dim, shape.hidden, world * (1 + (rank == 0)), 1, device=device)
    _expect_error(ValueError, "same experts configuration on every EP rank", ops.apply_expert_parallel, mismatched, dist.group.WORLD)
    # FP8 dispatch needs FP8 rowwise experts that build x^T from FP8 rows.
    bf16 = ops.MoE(shape.dim, shape.hidden, num_experts, 1, device=device)
    _expect_error(ValueError, "fp8_dispatch needs ops.Fp8GroupedExperts", ops.apply_expert_parallel, bf16, dist.group.WORLD, fp8_dispatch=True)
    unfolded_recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_wgrad_input_scales=False))
    unfolded = ops.convert_to_fp8(ops.MoE(shape.dim, shape.hidden, num_experts, 1, device=device), unfolded_recipe)
    _expect_error(ValueError, "fold_wgrad_input_scales=True", ops.apply_expert_parallel, unfolded, dist.group.WORLD, fp8_dispatch=True)
    # Recipes that differ across ranks (rank 0's cannot take FP8 rows): the set-up check raises on every rank.
    one_unfolded = ops.convert_to_fp8(
        ops.MoE(shape.dim, shape.hidden, num_experts, 1, device=device), unfolded_recipe if rank == 0 else ops.Fp8Recipe()
    )
    _expect_error(ValueError, "same experts configuration on every EP rank", ops.apply_expert_parallel, one_unfolded, dist.group.WORLD, fp8_dispatch=True)
    # Groups: not a group; a group without this rank (new_group is called by every rank).
    _expect_error(TypeError, "ProcessGroup or DeviceMesh", ops.apply_expert_parallel, bf16, "ep")
    others = dist.new_group([0])
    if rank != 0:
        _expect_error(ValueError, "not a member of the EP group", ops.apply_expert_parallel, bf16, others)
    # With FSDP2: expert parallelism after the FP8 all-gather wrapping; FP8 all-gather over a one-rank dp mesh.
    wrapped = ops.enable_fp8_all_gather(ops.convert_to_fp8(ops.MoE(shape.dim, shape.hidden, num_experts, 1, device=device)))
    _expect_error(ValueError, "before ops.enable_fp8_all_gather", ops.apply_expert_parallel, wrapped, dist.group.WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "ep"))
    layer = ops.convert_to_fp8(ops.MoE(shape.dim, shape.hidden, num_experts, 1, device=device))
    _expect_error(ValueError, "no expert-parallel experts module", ops.fully_shard_expert_parallel, layer, mesh["dp"])
    ops.apply_expert_parallel(layer, mesh, mesh_dim="ep")
    ops.enable_fp8_all_gather(layer)
    _expect_error(ValueError, "two or more ranks", ops.fully_shard_expert_parallel, layer, mesh["dp"])
    _expect_error(ValueError, "1-D DeviceMesh", ops.fully_shard_expert_parallel, layer, mesh)
    dist.barrier()


def _torchtitan_style_experts(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    """A foreign experts module (3-D w1/w2/w3, using to_local() as torchtitan's does) under EP, and a DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    class Experts(nn.Module):
        def __init__(self, experts: ops.GroupedExperts) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = experts.w1, experts.w2, experts.w3

        def forward(self, x, num_tokens_per_expert):
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            h = torch.nn.functional.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    reference = _layer(shape, world, False, device)
    layer = _layer(shape, world, False, device)
    layer.experts = Experts(layer.experts)
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "ep"))
    ops.apply_expert_parallel(layer, mesh, mesh_dim="ep")
    inputs = _cases(shape, world, device)["edge"]
    rows = [0] + torch.tensor([x.shape[0] for x, *_ in inputs]).cumsum(0).tolist()
    joined = [torch.cat([inp[i] for inp in inputs]) for i in range(4)]
    expected = _run(reference, *joined)
    result = _run(layer, *inputs[rank])
    for name in ("out", "dx", "dprobs"):
        _check_equal(result[name], expected[name][rows[rank] : rows[rank + 1]], f"torchtitan-style {name}", device.type == "cpu")


def _dropped_pairs(experts: torch.Tensor, num_experts: int, world: int, capacity: int) -> torch.Tensor:
    """``(T, k)`` bool, the plain rule: sorted by expert, a rank's rows past the first ``capacity`` it has
    for one destination rank are dropped."""
    experts = experts.cpu()
    order = ops.sort_by_expert(experts, num_experts).order
    dest = experts.flatten()[order] // (num_experts // world)
    counts = torch.bincount(dest, minlength=world)
    within = torch.arange(dest.numel()) - (counts.cumsum(0) - counts)[dest]
    dropped = torch.zeros(experts.numel(), dtype=torch.bool)
    dropped[order] = within >= capacity
    return dropped.view(experts.shape)


def _capacity_layer(shape: Shape, world: int, experts_kind: str, fp8_dispatch: bool, device, **kwargs) -> ops.MoE:
    layer = _layer(shape, world, experts_kind == "fp8", device)
    ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=fp8_dispatch, **kwargs)
    return layer


def _check_fp8_dispatch_of_a_view(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    """FP8 dispatch of tokens that are a column slice (not contiguous): bitwise the contiguous tokens' result,
    also with no tokens on one rank (whose empty slice is contiguous)."""
    layer = _layer(shape, world, True, device)
    ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=True)
    x, probs, experts, grad = _cases(shape, world, device)["edge"][rank]
    if rank == 0:
        x, probs, experts, grad = x[:0], probs[:0], experts[:0], grad[:0]
    wide = torch.cat([x, x], dim=1)[:, : shape.dim]
    assert wide.shape[0] == 0 or not wide.is_contiguous()
    expected = layer.apply_experts(x.contiguous(), probs, experts)
    assert torch.equal(layer.apply_experts(wide, probs, experts), expected)
    dist.barrier()


def _check_capacity_mode(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    """The no-sync mode against the exact one: bitwise when nothing overflows; dropped pairs as pairs with
    probability 0; overflow raised one call late on every rank, or counted; misrouted rows raised the same way."""
    num_experts = shape.experts_per_rank * world
    inputs = _cases(shape, world, device)["edge"]
    x, probs, experts, grad = inputs[rank]
    most = max(
        int(torch.bincount(e.flatten().cpu() // shape.experts_per_rank, minlength=world).max()) if e.numel() else 0
        for _, _, e, _ in inputs
    )
    for experts_kind, fp8_dispatch in (("bf16", False), ("fp8", True)):
        label = f"{experts_kind} experts, {'fp8' if fp8_dispatch else 'bf16'} dispatch, rank {rank}"
        exact = _capacity_layer(shape, world, experts_kind, fp8_dispatch, device)
        expected = _run(exact, x, probs, experts, grad)
        if experts_kind == "bf16":
            # The exact mode under activation checkpointing (its count exchange runs again in backward).
            recomputed = _run(exact, x, probs, experts, grad, checkpointed=True)
            for name in ("out", "dx", "dprobs", "w1", "w2", "w3"):
                _check_equal(recomputed[name], expected[name], f"checkpointed exact: {name} ({label})", exact=True)
        # Capacity that fits every rank's rows: the same numbers, bitwise (the experts get filler rows
        # past offs[-1], which they do not read).
        roomy = _capacity_layer(shape, world, experts_kind, fp8_dispatch, device, capacity=most + 3)
        result = _run(roomy, x, probs, experts, grad)
        for name in ("out", "dx", "dprobs", "w1", "w2", "w3"):
            _check_equal(result[name], expected[name], f"capacity {most + 3}: {name} ({label})", exact=True)
        totals = roomy.experts.expert_parallel.check_overflow()
        assert (sum(totals.dropped), sum(totals.misrouted), totals.most_rows) == (0, 0, most), (totals, most)
        # A capacity that drops rows, counted: the exact layer with the dropped pairs' probabilities 0.
        tight = max(most // 3, 1)
        dropped = _dropped_pairs(experts, num_experts, world, tight).to(device)
        counted = _capacity_layer(shape, world, experts_kind, fp8_dispatch, device, capacity=tight, on_overflow="drop")
        result = _run(counted, x, probs, experts, grad)
        expected = _run(exact, x, probs.masked_fill(dropped, 0), experts, grad)
        for name in ("out", "dx"):
            _check_equal(result[name], expected[name], f"capacity {tight}: {name} ({label})", exact=True)
        assert torch.equal(result["dprobs"][~dropped], expected["dprobs"][~dropped]), label
        assert not result["dprobs"][dropped].any(), label
        for name in ("w1", "w2", "w3"):
            _check_close(result[name], expected[name], f"capacity {tight}: {name} ({label})", device)
        all_dropped = torch.tensor([int(dropped.sum())], device=device)
        dist.all_reduce(all_dropped)
        assert all_dropped.item() > 0, "the tight capacity must drop rows somewhere"
        totals = counted.experts.expert_parallel.overflow()
        assert (sum(totals.dropped), totals.most_rows) == (all_dropped.item(), most), totals
        if experts_kind == "bf16":
            # Under activation checkpointing: the same numbers, and the recomputed forward's rows not
            # counted again.
            checkpointed = _capacity_layer(shape, world, experts_kind, fp8_dispatch, device, capacity=tight, on_overflow="drop")
            recomputed = _run(checkpointed, x, probs, experts, grad, checkpointed=True)
            for name in ("out", "dx", "dprobs", "w1", "w2", "w3"):
                _check_equal(recomputed[name], result[name], f"checkpointed: {name} ({label})", exact=True)
            assert checkpointed.experts.expert_parallel.overflow() == totals
    # on_overflow="raise": the call after the one that overflowed raises, on every rank, before any
    # collective; the layer goes on afterwards; check_overflow() raises at once.
    layer = _capacity_layer(shape, world, "bf16", False, device, capacity=tight)
    layer.apply_experts(x, probs, experts)
    _expect_error(ops.CapacityOverflowError, rf"capacity={tight} .* in a call was {most}: raise capacity", layer.apply_experts, x, probs, experts)
    layer.apply_experts(x, probs, experts)
    _expect_error(ops.CapacityOverflowError, "dropped", layer.experts.expert_parallel.check_overflow)
    # check_overflow() changes nothing: the next call still raises, and the one after works.
    _expect_error(ops.CapacityOverflowError, "dropped", layer.apply_experts, x, probs, experts)
    layer.apply_experts(x, probs, experts)
    # check_overflow() on one rank only (logging): the next call still raises on every rank.
    layer = _capacity_layer(shape, world, "bf16", False, device, capacity=tight)
    layer.apply_experts(x, probs, experts)
    if rank == 0:
        _expect_error(ops.CapacityOverflowError, "dropped", layer.experts.expert_parallel.check_overflow)
    _expect_error(ops.CapacityOverflowError, "dropped", layer.apply_experts, x, probs, experts)
    layer.apply_experts(x, probs, experts)
    # A first call in inference mode (an evaluation before training), then training calls.
    layer = _capacity_layer(shape, world, "bf16", False, device, capacity=most, on_overflow="drop")
    with torch.inference_mode():
        layer.apply_experts(x, probs, experts)
    layer.apply_experts(x, probs, experts).backward(grad)
    assert sum(layer.experts.expert_parallel.overflow().dropped) == 0
    # Routing outside [0, E) on one rank: dropped, and raised by every rank at the next call.
    layer = _capacity_layer(shape, world, "bf16", False, device, capacity=most)
    bad = experts.clone()
    if rank == world - 1:
        bad[0, 0] = num_experts
    for on_overflow in ("raise", "drop"):
        layer = _capacity_layer(shape, world, "bf16", False, device, capacity=most, on_overflow=on_overflow)
        layer.apply_experts(x, probs, bad)
        _expect_error(ValueError, rf"EP ranks \[{world - 1}\]", layer.apply_experts, x, probs, experts)
        layer.apply_experts(x, probs, experts)
        assert sum(layer.experts.expert_parallel.check_overflow().dropped) == 0
    # Bad capacities; capacities that differ across ranks (the set-up check, on every rank).
    for capacity in (0, -1, 2.0, True):
        _expect_error(ValueError, "capacity must be None or a positive int", ops.apply_expert_parallel,
                      _layer(shape, world, False, device), dist.group.WORLD, capacity=capacity)
    _expect_error(ValueError, "on_overflow must be one of", ops.apply_expert_parallel,
                  _layer(shape, world, False, device), dist.group.WORLD, capacity=4, on_overflow="ignore")
    _expect_error(ValueError, "same experts configuration on every EP rank", ops.apply_expert_parallel,
                  _layer(shape, world, False, device), dist.group.WORLD, capacity=4 + rank)
    _expect_error(ValueError, "applies to the capacity mode", exact.experts.expert_parallel.overflow)
    dist.barrier()


def _check_wgrad_accumulation(rank: int, world: int, shape: Shape, device: torch.device) -> None:
    """``wgrad_accumulation`` and ``deferred_wgrad`` under EP: with ``"grad"``, or with the deferred wgrad,
    two micro-batches' gradients are bitwise those of ``"off"`` (the sharded weights' local views are not
    leaves: autograd adds, and nothing is deferred); ``"main_grad"`` raises on every rank before any expert
    kernel, and the layer works afterwards."""
    x, probs, experts, grad = _cases(shape, world, device)["edge"][rank]

    def layer_with(target: str, deferred_wgrad: bool = False) -> ops.MoE:
        layer = _layer(shape, world, False, device)
        options = ops.RowwiseOptions(wgrad_accumulation=target, deferred_wgrad=deferred_wgrad)
        ops.convert_to_fp8(layer, ops.Fp8Recipe(wgrad_precision="fp8", options=options))
        ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=True)
        return layer

    sums = {}
    for target, deferred_wgrad in (("off", False), ("grad", False), ("grad", True)):
        layer = layer_with(target, deferred_wgrad)
        for _ in range(2):
            layer.apply_experts(x, probs, experts).backward(grad)
        assert not ops.has_deferred_wgrads(layer)
        sums[target, deferred_wgrad] = [getattr(layer.experts, n).grad.to_local() for n in ("w1", "w2", "w3")]
    for variant in (("grad", False), ("grad", True)):
        for name, off, other in zip(("w1", "w2", "w3"), sums["off", False], sums[variant]):
            assert torch.equal(off, other), (name, variant)
    layer = layer_with("main_grad")
    _expect_error(ValueError, "plain leaf parameter", layer.apply_experts, x, probs, experts)
    dist.barrier()


def _all_checks(rank: int, world: int, device_type: str, shape: Shape) -> None:
    device = torch.device(device_type, rank if device_type == "cuda" else 0) if device_type == "cuda" else torch.device("cpu")
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    _check_against_reference(rank, world, shape, device)
    _check_fp8_dispatch_matches_quantize_after(rank, world, shape, device)
    _torchtitan_style_experts(rank, world, shape, device)
    _check_bad_input(rank, world, shape, device)
    _check_fp8_dispatch_of_a_view(rank, world, shape, device)
    _check_wgrad_accumulation(rank, world, shape, device)


def _capacity_checks(rank: int, world: int, device_type: str, shape: Shape) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    _check_capacity_mode(rank, world, shape, device)


# Two ranks and three (an uneven world) on the CPU; the GPU test runs two and four.
CHECKS = {"exact": _all_checks, "capacity": _capacity_checks}


@gloo_cpu_only
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("checks", sorted(CHECKS))
def test_expert_parallel_cpu(world, checks):
    run_distributed(CHECKS[checks], world, "cpu", CPU_SHAPE, backend="gloo", timeout_s=300)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("checks", sorted(CHECKS))
def test_expert_parallel_gpu(world, checks):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    run_distributed(CHECKS[checks], world, "cuda", GPU_SHAPE, backend="nccl", timeout_s=300)


def _syncs(layer: ops.MoE, x: torch.Tensor) -> tuple[int, int, list[str]]:
    """Host syncs of one forward and of its backward (``torch.cuda.set_sync_debug_mode``), after a warm-up step."""
    layer(x).sum().backward()  # warm-up: compilation, autotune-cache reads, allocator
    torch.cuda.synchronize()
    counts, messages = [], []
    for phase in ("forward", "backward"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if phase == "forward":
                    out = layer(x)
                else:
                    out.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Only the operations (the mode's first use also warns that it is a prototype).
        syncs = [f"{phase}: {w.message}" for w in caught if "called a synchronizing" in str(w.message)]
        counts.append(len(syncs))
        messages += syncs
    return counts[0], counts[1], messages


def _count_syncs(rank: int, world: int, shape: Shape) -> None:
    """Expert parallelism adds exactly one host sync to the layer's forward and none to its backward;
    the capacity mode adds none.

    Measured against the same layer on one GPU without expert parallelism (which has
    none with FP8 experts; bf16 experts call ``torch._grouped_mm``, whatever it does).
    """
    device = torch.device("cuda", rank)
    for fp8, fp8_dispatch in ((False, False), (True, False), (True, True)):
        x = torch.randn(shape.tokens, shape.dim, dtype=torch.bfloat16, device=device, requires_grad=True)
        base_forward, base_backward, base_messages = _syncs(_layer(shape, world, fp8, device), x)
        layer = _layer(shape, world, fp8, device)
        ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=fp8_dispatch)
        forward, backward, messages = _syncs(layer, x)
        label = f"fp8={fp8}, fp8_dispatch={fp8_dispatch}"
        print(f"rank {rank} {label}: one GPU {base_forward}/{base_backward}, EP {forward}/{backward}", flush=True)
        assert (forward, backward) == (base_forward + 1, base_backward), (label, base_messages, messages)
        if fp8:
            assert (base_forward, base_backward) == (0, 0), (label, base_messages)
        layer = _layer(shape, world, fp8, device)
        ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=fp8_dispatch, capacity=shape.tokens * shape.top_k)
        forward, backward, messages = _syncs(layer, x)
        print(f"rank {rank} {label}, capacity mode: EP {forward}/{backward}", flush=True)
        assert (forward, backward) == (base_forward, base_backward), (label, base_messages, messages)


def _graph_step(layer: ops.MoE, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out, x.grad


def _weight_grads(layer: ops.MoE) -> list[torch.Tensor]:
    return [getattr(layer.experts, n).grad.to_local().clone() for n in ("w1", "w2", "w3")]


def _capture_step(layer: ops.MoE, static_x: torch.Tensor, grad: torch.Tensor):
    """``(graph, out, dx, weight grads)``: a layer step captured after warm-up steps on a side stream.

    Nothing runs on the default stream before the capture: an eager step's autograd graph still
    alive would make the captured backward join the default stream (cudaErrorStreamCaptureImplicit).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            _graph_step(layer, static_x, grad)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    gc.collect()  # before capturing, as for any capture (torch.cuda.graph does not)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dx = _graph_step(layer, static_x, grad)
    # The graph's own gradient tensors, which its replays write (eager steps will replace .grad).
    grads = [getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")]
    return graph, out, dx, grads


def _capture_layer(rank: int, world: int, shape: Shape) -> None:
    """The no-sync mode on one GPU (EP=1 over NCCL), FP8 experts and dispatch: a whole layer step (router,
    dispatch, experts, return, combine, backward) captured in one CUDA graph whose replays on new batches
    (new routing, new counts) equal eager steps bitwise; no host sync in eager forward or backward."""
    device = torch.device("cuda", rank)
    rows = shape.tokens * shape.top_k  # EP=1: every row goes to this rank
    gen = torch.Generator(device=device).manual_seed(3)
    batches = [torch.randn(shape.tokens, shape.dim, generator=gen, device=device).to(torch.bfloat16) for _ in range(3)]
    grad = torch.randn(shape.tokens, shape.dim, generator=gen, device=device).to(torch.bfloat16)
    layer = _layer(shape, world, True, device)
    ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=True, capacity=rows)
    static_x = batches[0].clone()
    graph, out, dx, graph_grads = _capture_step(layer, static_x, grad)
    forward, backward, messages = _syncs(layer, batches[0])
    assert (forward, backward) == (0, 0), messages
    expected = []
    for x in batches:
        layer.zero_grad(set_to_none=True)
        want_out, want_dx = _graph_step(layer, x, grad)
        expected.append((want_out.detach(), want_dx, _weight_grads(layer)))
    for x, (want_out, want_dx, want_w) in zip(batches[::-1], expected[::-1]):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
        for got, want in zip(graph_grads, want_w):
            assert torch.equal(got.to_local(), want)
    assert sum(layer.experts.expert_parallel.check_overflow().dropped) == 0
    # Drops counted on the device across steps: two warm-up steps and three replays (a capture runs nothing).
    layer = _layer(shape, world, True, device)
    ops.apply_expert_parallel(layer, dist.group.WORLD, fp8_dispatch=True, capacity=rows // 2, on_overflow="drop")
    graph = _capture_step(layer, batches[0].clone(), grad)[0]
    for _ in range(3):
        graph.replay()
    assert sum(layer.experts.expert_parallel.overflow().dropped) == 5 * (rows - rows // 2)


@pytest.mark.cuda
def test_capacity_mode_captures_in_a_cuda_graph():
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    run_distributed(_capture_layer, 1, GPU_SHAPE, backend="nccl", timeout_s=300)


@pytest.mark.cuda
def test_one_host_sync_per_forward_none_in_backward():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_count_syncs, 2, GPU_SHAPE, backend="nccl", timeout_s=300)


# --- single process -----------------------------------------------------------


def test_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ops.apply_expert_parallel(ops.MoE(32, 32, 4, 2), None)


def test_prequantized_rows_bitwise_equal_to_quantizing_x():
    """``fp8_grouped_linears(anchor, ..., x_fp8=quantize_rowwise_rows(x))``: out, dx, dW bitwise those of quantizing x."""
    from tests.support import DEVICE, offsets_from_sizes

    sizes = [0, 5, 1, 18]
    x = torch.randn(sum(sizes) + 3, 32, device=DEVICE).to(torch.bfloat16)  # 3 rows past the last group
    weights = [(torch.randn(len(sizes), n, 32, device=DEVICE) * 0.2).to(torch.bfloat16) for n in (16, 48)]
    offs = offsets_from_sizes(sizes)
    grads = [torch.randn(x.shape[0], w.shape[1], device=DEVICE).to(torch.bfloat16) for w in weights]

    def run(prequantized: bool):
        ws = [w.clone().requires_grad_() for w in weights]
        if prequantized:
            data, scales = kernel_ops.quantize_rowwise_rows(x, torch.float8_e4m3fn, False)
            xr = x.new_zeros(()).expand(x.shape).requires_grad_()
            outs = ops.fp8_grouped_linears(xr, ws, offs, x_fp8=(data, scales))
        else:
            xr = x.clone().requires_grad_()
            outs = ops.fp8_grouped_linears(xr, ws, offs)
        torch.autograd.backward(outs, grads)
        return [*outs, xr.grad, *(w.grad for w in ws)]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_fp8_dispatch_needs_a_recipe_that_takes_rows():
    # Checked before the group is read.
    with pytest.raises(ValueError, match="fp8_dispatch needs ops.Fp8GroupedExperts whose recipe takes"):
        ops.ExpertParallel(None, 4, fp8_dispatch=True)
    with pytest.raises(ValueError, match="takes_prequantized_rows"):
        ops.ExpertParallel(None, 4, fp8_dispatch=True, recipe=ops.Fp8Recipe(name="blockwise"))


def test_prequantized_rows_bad_input():
    from tests.support import DEVICE, offsets_from_sizes

    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(2, 16, 32, device=DEVICE).to(torch.bfloat16)
    offs = offsets_from_sizes([3, 5])
    data, scales = kernel_ops.quantize_rowwise_rows(x, torch.float8_e4m3fn, False)
    with pytest.raises(ValueError, match="fold_wgrad_input_scales=True, save_fp8_input=True"):
        unfolded = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_wgrad_input_scales=False))
        ops.fp8_grouped_linears(x, [w], offs, unfolded, x_fp8=(data, scales))
    with pytest.raises(ValueError, match="needs a recipe with takes_prequantized_rows"):
        ops.fp8_grouped_linears(x, [w], offs, ops.Fp8Recipe(name="blockwise"), x_fp8=(data, scales))
    with pytest.raises(ValueError, match="x_fp8 data must have x's shape"):
        ops.fp8_grouped_linears(x, [w], offs, x_fp8=(data[:4], scales[:4]))
    with pytest.raises(ValueError, match="x_fp8 scales must have shape"):
        ops.fp8_grouped_linears(x, [w], offs, x_fp8=(data, scales[:4]))
    with pytest.raises(TypeError, match="x_fp8 must be a pair"):
        ops.fp8_grouped_linears(x, [w], offs, x_fp8=data)
    with pytest.raises(ValueError, match="x_fp8 .pre-quantized rows. needs FP8 experts"):
        ops.GroupedExperts(32, 16, 2, device=DEVICE)(x, torch.tensor([3, 5], device=DEVICE), x_fp8=(data, scales))


def test_moe_layer_matches_dense_per_token_reference():
    """The layer without EP: each token's output is the prob-weighted sum of its experts' SwiGLU outputs."""
    from tests.support import DEVICE

    moe = ops.MoE(32, 32, 4, 2, device=DEVICE)
    x = torch.randn(10, 32, device=DEVICE).to(torch.bfloat16)
    probs, experts = moe.route(x)
    experts[0] = torch.tensor([3, 3])  # the same expert twice
    out = moe.apply_experts(x, probs, experts)
    w1, w2, w3 = (w.float() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    expected = torch.zeros(10, 32, device=DEVICE)
    for t in range(10):
        for j in range(2):
            e = experts[t, j]
            h = torch.nn.functional.silu(x[t].float() @ w1[e].T) * (x[t].float() @ w3[e].T)
            expected[t] += probs[t, j] * (h @ w2[e].T)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "dtype, row_shape, word",
    [
        (torch.bfloat16, (48,), torch.int64),
        (torch.uint8, (40,), torch.int64),  # FP8 rows as bytes
        (torch.float8_e4m3fn, (24,), torch.int64),
        (torch.float32, (3, 4), torch.int64),  # (T, k, dim) pairs
        (torch.bfloat16, (6,), torch.int32),  # 12 bytes
        (torch.bfloat16, (3,), None),  # 6 bytes: no word wider than 2 bytes divides them
        (torch.uint8, (6,), torch.int16),
        (torch.uint8, (5,), None),
    ],
)
def test_gather_rows_equals_index_select(dtype, row_shape, word):
    from ops.row_gather import gather_rows, row_word
    from tests.support import DEVICE

    values = torch.randn(33, *row_shape, device=DEVICE) * 100
    values[1] = float("nan")
    t = values.to(dtype)
    index = torch.randint(0, 33, (57,), device=DEVICE)
    expected = t.index_select(0, index)
    assert row_word(t) == word

    def check(src: torch.Tensor, idx: torch.Tensor, want: torch.Tensor) -> None:
        got = gather_rows(src, idx)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))

    check(t, index, expected)
    check(t, index[:0], expected[:0])  # no rows wanted
    check(t[:0], index[:0], expected[:0])  # an empty source (an EP rank that received nothing)
    # Rows that start one element past a word boundary: gathered as they are.
    shifted = torch.empty(t.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(t.shape)
    shifted.copy_(t)
    assert row_word(shifted) is None
    check(shifted, index, expected)
    if t.dim() == 2:  # not contiguous: gathered as it is
        strided = t.t().contiguous().t()
        assert row_word(strided) is None
        check(strided, index, expected)
