"""Expert parallelism against a single-process run of the same layer; FP8 dispatch; the host-sync count; bad input.

Each distributed test spawns one process group (gloo on the CPU, NCCL on GPUs) and
runs every case in it: the EP layer on each rank's tokens against the same layer
with all experts in one process on all ranks' tokens (every rank computes it).
Forward outputs and input gradients must be bitwise equal, weight gradients equal
up to summation order. On GPUs the single-process run's larger GEMMs may get other
kernel configurations (tile sizes, hence the order of the fp32 sums) than each rank's,
so there the comparison with it is by SQNR (and whether it is bitwise is printed);
the comparisons within one rank (FP8 vs bf16 dispatch, quantization before vs after
the exchange) are bitwise everywhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
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


def _run(moe: ops.MoE, x, probs, experts, grad) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    if probs is None:
        out = moe(x)
    else:
        probs = probs.clone().requires_grad_()
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


def _all_checks(rank: int, world: int, device_type: str, shape: Shape) -> None:
    device = torch.device(device_type, rank if device_type == "cuda" else 0) if device_type == "cuda" else torch.device("cpu")
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    _check_against_reference(rank, world, shape, device)
    _check_fp8_dispatch_matches_quantize_after(rank, world, shape, device)
    _torchtitan_style_experts(rank, world, shape, device)
    _check_bad_input(rank, world, shape, device)


# Two ranks and three (an uneven world) on the CPU; the GPU test runs two and four.
@gloo_cpu_only
@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_cpu(world):
    run_distributed(_all_checks, world, "cpu", CPU_SHAPE, backend="gloo", timeout_s=300)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gpu(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    run_distributed(_all_checks, world, "cuda", GPU_SHAPE, backend="nccl", timeout_s=300)


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
    """Expert parallelism adds exactly one host sync to the layer's forward and none to its backward.

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
