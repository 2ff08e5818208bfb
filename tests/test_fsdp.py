"""FSDP2 (``fully_shard``) with the FP8 expert modules, against single-process runs of the same computation.

Each test spawns ``world`` processes (gloo on CPU tensors, under Triton's
interpreter; NCCL on GPUs, ``cuda``-marked and skipped without enough GPUs).
Rank 0 also runs the unsharded reference. Checked:

- converting before or after ``fully_shard`` (per block and the whole model),
  with bf16 or FP8 all-gather, with activation checkpointing, and with compiled
  blocks: training steps match the unsharded model (forward outputs bitwise,
  gradients and updated weights up to the reduce-scatter's rounding);
- FP8 all-gather: the gathered weight is bitwise the single-process
  quantization of the whole weight, and every step is bitwise that of bf16 all-gather;
- a distributed checkpoint saved under FSDP2 loads into a single-process model.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import ops
from tests.support import gloo_cpu_only, rank_device, run_distributed

# Per collective, and for the whole run: the interpreter's steps are slow on a loaded CPU.
COLLECTIVE_TIMEOUT_S = 300
JOIN_TIMEOUT_S = 1200


class Block(nn.Module):
    """A residual block of SwiGLU experts over tokens already sorted by expert."""

    def __init__(self, dim: int, hidden: int, experts: int, checkpoint: bool = False) -> None:
        super().__init__()
        self.experts = ops.GroupedExperts(dim, hidden, experts)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self.experts, x, counts, use_reentrant=False)
        return x + self.experts(x, counts)


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, layers: int, checkpoint: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden, experts, checkpoint) for _ in range(layers))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, counts)
        return x


# Under Triton's interpreter a grouped linear's step takes seconds: one block on CPU.
CPU_SHAPE = {"dim": 32, "hidden": 48, "experts": 4, "layers": 1, "tokens": 40}
GPU_SHAPE = {"dim": 1024, "hidden": 512, "experts": 8, "layers": 2, "tokens": 4096}


def _make_model(shape: dict, device: torch.device, checkpoint: bool = False) -> Model:
    torch.manual_seed(1234)
    dims = (shape["dim"], shape["hidden"], shape["experts"], shape["layers"])
    return Model(*dims, checkpoint=checkpoint).to(device)


def _batch(shape: dict, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens of step ``step`` and their per-expert counts (an empty group, unaligned sizes)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(shape["tokens"], shape["dim"], generator=g).to(torch.bfloat16)
    e, t = shape["experts"], shape["tokens"]
    counts = torch.full((e,), t // (e - 1), dtype=torch.int64)
    counts[1] = 0
    counts[-1] = t - counts.sum() + counts[-1]
    return x.to(device), counts.to(device)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _shard(model: Model, mesh, order: str, fp8_all_gather: bool, compile_blocks: bool) -> Model:
    """``model`` converted to FP8 and sharded with FSDP2, converting before or after ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard

    if order == "before":
        ops.convert_to_fp8(model)
        if fp8_all_gather:
            ops.enable_fp8_all_gather(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
        if compile_blocks:
            layer.compile(backend="aot_eager" if mesh.device_type == "cpu" else "inductor")
    fully_shard(model, mesh=mesh)
    if order == "after":
        ops.convert_to_fp8(model)
    elif order == "after-per-block":
        for layer in model.layers:
            ops.convert_to_fp8(layer)
    return model


def _train(model: Model, shape: dict, ranks: list[int], steps: int, device: torch.device) -> list[dict]:
    """``steps`` SGD steps; each step's loss and gradient averaged over ``ranks``' batches (one each)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for step in range(steps):
        outs = []
        for rank in ranks:
            x, counts = _batch(shape, rank, step, device)
            out = model(x.requires_grad_(), counts)  # dx too: the first block's dgrad runs
            (_loss(out) / len(ranks)).backward()
            outs.append(out.detach())
        history.append({"outs": outs, "grads": {n: _full(p.grad) for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
    history.append({"weights": {n: _full(p.detach()) for n, p in model.named_parameters()}})
    return history


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return getattr(t, "hp", t).clone()  # Fp8AllGatherWeight holds the high-precision values


def _gathered_weights(model: Model) -> list[object]:
    """What the experts' forward sees (FSDP2's gathered weights), recorded by a forward pre-hook.

    An ``Fp8WeightTensor`` is recorded as a copy of its parts (FSDP2 frees the gathered
    storage after the forward), any other weight as its type.
    """
    seen: list[object] = []

    def record(w: torch.Tensor) -> object:
        w = w._local_tensor if isinstance(w, DTensor) else w  # expert parallelism: this rank's experts
        if isinstance(w, ops.Fp8WeightTensor):
            return w.data_fp8.clone(), w.scales.clone()
        return type(w)

    def hook(module: nn.Module, args: object) -> None:
        seen.extend(record(w) for w in (module.w1, module.w2, module.w3))

    for layer in model.layers:
        layer.experts.register_forward_pre_hook(hook)
    return seen


# Helion prints these when it takes a kernel compiled in a process with a process group for a
# symmetric-memory kernel (ours never are; kernels_helion.torch_compat lets helion tell on torch 2.11).
DISTRIBUTED_COMPILE_WARNINGS = ("ProcessGroupNameNotFound", "max_num_sm_multipler")


@contextlib.contextmanager
def _no_distributed_compile_warnings() -> Iterator[None]:
    """Fail if a kernel compile prints (Helion's warnings go to stderr) or warns one of ``DISTRIBUTED_COMPILE_WARNINGS``."""
    captured = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(captured):
        warnings.simplefilter("always")
        yield
    sys.stderr.write(captured.getvalue())
    text = captured.getvalue() + "\n".join(str(w.message) for w in caught)
    for name in DISTRIBUTED_COMPILE_WARNINGS:
        assert name not in text, f"a kernel compile under torch.distributed printed {name}"


def _worker_training(rank: int, world: int, cases: list[tuple], shape: dict) -> None:
    device = rank_device(rank, dist.get_backend())
    with _no_distributed_compile_warnings():
        _training_cases(rank, world, device, cases, shape)


def _training_cases(rank: int, world: int, device: torch.device, cases: list[tuple], shape: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    reference = None
    if rank == 0:
        reference = _train(ops.convert_to_fp8(_make_model(shape, device)), shape, list(range(world)), 2, device)
    by_gather: dict[tuple, list[dict]] = {}
    for order, fp8_all_gather, checkpoint, compile_blocks in cases:
        torch._dynamo.reset()
        model = _shard(_make_model(shape, device, checkpoint), mesh, order, fp8_all_gather, compile_blocks)
        gathered = _gathered_weights(model)
        history = _train(model, shape, [rank], 2, device)
        label = f"order={order} fp8_all_gather={fp8_all_gather} checkpoint={checkpoint} compiled={compile_blocks}"
        if fp8_all_gather:
            _check_gathered(gathered, shape, device, label)
        else:
            assert gathered and all(w in (torch.Tensor, nn.Parameter) for w in gathered), label
        history = _gather_history(history, world)
        if rank == 0:
            # On the GPU, Inductor's kernels for the compiled blocks' elementwise math need not round as eager
            # does (on an H100 step 0's output is not bitwise equal to eager's), so there step 0 is compared
            # within the later steps' tolerance; on the CPU the compiled blocks are bitwise equal to eager.
            _compare(history, reference, label, bitwise_first_step=not (compile_blocks and device.type == "cuda"))
            key = (checkpoint, compile_blocks)
            if key in by_gather:  # FP8 and bf16 all-gather: the same values, bit for bit
                _compare(history, by_gather[key], label, exact=True)
            by_gather[key] = history


def _check_gathered(
    gathered: list[torch.Tensor], shape: dict, device: torch.device, label: str, experts: slice = slice(None)
) -> None:
    """Each gathered weight is an Fp8WeightTensor bitwise equal to quantizing the whole weight in one process
    (with expert parallelism, the ``experts`` this rank holds)."""
    import kernels_helion

    assert gathered and all(isinstance(w, tuple) for w in gathered), label
    # The first forward's weights are the initial ones: rebuild them unsharded.
    initial = _make_model(shape, device)
    expected = [w for layer in initial.layers for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3)]
    for (data, data_scales), ref in zip(gathered[: len(expected)], expected):
        q, scales = kernels_helion.quantize_rowwise_expert_weights(ref.detach()[experts].contiguous())
        assert torch.equal(data.view(torch.uint8), q.view(torch.uint8)), label
        assert torch.equal(data_scales, scales), label


def _gather_history(history: list[dict], world: int) -> list[dict]:
    """Every rank's forward outputs, so that rank 0 holds them all (gradients and weights are already full)."""
    for entry in history[:-1]:
        outs = [None] * world
        dist.all_gather_object(outs, [o.cpu() for o in entry["outs"]])
        entry["outs"] = [o for per_rank in outs for o in per_rank]
    return history


def _shard_expert_parallel(model: Model, mesh, order: str, fp8_dispatch: bool, fp8_all_gather: bool) -> Model:
    """``model`` with its experts sharded over ``mesh["ep"]`` (expert parallelism) and each rank's experts
    sharded by FSDP2 over ``mesh["dp"]``; everything else FSDP2-sharded over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if order == "before":
        ops.convert_to_fp8(model)
    ops.apply_expert_parallel(model, mesh, mesh_dim="ep", fp8_dispatch=fp8_dispatch)
    if fp8_all_gather:
        ops.enable_fp8_all_gather(model)
    everyone = init_device_mesh(mesh.device_type, (mesh.size(),))
    assert ops.fully_shard_expert_parallel(model, mesh["dp"]) == [layer.experts for layer in model.layers]
    for layer in model.layers:
        fully_shard(layer, mesh=everyone)
    fully_shard(model, mesh=everyone)
    if order == "after":
        ops.convert_to_fp8(model)
    return model


def _worker_expert_parallel(rank: int, world: int, cases: list[tuple], shape: dict) -> None:
    """FSDP2 over ``dp`` with expert parallelism over ``ep`` (mesh ``(world / 2, 2)``) against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    device = rank_device(rank, dist.get_backend())
    ep = 2
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    local = shape["experts"] // ep
    mine = slice(mesh["ep"].get_local_rank() * local, (mesh["ep"].get_local_rank() + 1) * local)
    # The interpreter's steps are slow and the CPU reference trains on all four ranks' batches: one step
    # there (forward, gradients, update), two on GPUs (the second gathers updated weights).
    steps = 1 if device.type == "cpu" else 2
    reference = None
    if rank == 0:
        reference = _train(ops.convert_to_fp8(_make_model(shape, device)), shape, list(range(world)), steps, device)
    by_gather: dict[tuple, list[dict]] = {}
    for order, fp8_dispatch, fp8_all_gather in cases:
        model = _shard_expert_parallel(_make_model(shape, device), mesh, order, fp8_dispatch, fp8_all_gather)
        gathered = _gathered_weights(model)
        history = _train(model, shape, [rank], steps, device)
        label = f"expert parallel: order={order} fp8_dispatch={fp8_dispatch} fp8_all_gather={fp8_all_gather}"
        if fp8_all_gather:
            _check_gathered(gathered, shape, device, label, mine)
        else:
            assert gathered and all(w in (torch.Tensor, nn.Parameter) for w in gathered), label
        history = _gather_history(history, world)
        if rank == 0:
            # On GPUs each rank's GEMMs (the rows of two ranks per expert) may take other kernel configurations
            # than the single process's, so there step 0 is compared within the later steps' tolerance.
            _compare(history, reference, label, bitwise_first_step=device.type == "cpu")
            if fp8_dispatch in by_gather:  # FP8 and bf16 all-gather: the same values, bit for bit
                _compare(history, by_gather[fp8_dispatch], label, exact=True)
            by_gather[fp8_dispatch] = history


def _compare(
    history: list[dict], reference: list[dict], label: str, exact: bool = False, bitwise_first_step: bool = True
) -> None:
    for step, (entry, ref) in enumerate(zip(history[:-1], reference[:-1])):
        # Step 0's forward runs the same weights on the same tokens: bitwise. Later steps follow
        # weights updated from reduce-scattered gradients (rounded in another order).
        for out, ref_out in zip(entry["outs"], ref["outs"]):
            if (step == 0 and bitwise_first_step) or exact:
                assert torch.equal(out.cpu(), ref_out.cpu()), f"{label}: step {step} output"
            else:
                torch.testing.assert_close(out.cpu(), ref_out.cpu(), rtol=0.05, atol=0.05, msg=label)
        for name, grad in entry["grads"].items():
            _close(grad, ref["grads"][name], exact, f"{label}: step {step} grad {name}")
    for name, w in history[-1]["weights"].items():
        _close(w, reference[-1]["weights"][name], exact, f"{label}: weight {name}")


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool, msg: str) -> None:
    if exact:
        assert torch.equal(a.cpu(), b.cpu()), msg
    else:
        # bf16 gradients summed over ranks by the reduce-scatter vs accumulated in one process.
        torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=0.02, atol=2e-3, msg=msg)


def _worker_checkpoint(rank: int, world: int, shape: dict, path: str) -> None:
    """Save a distributed checkpoint under FSDP2 (FP8 all-gather); rank 0 loads it into a single-process model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    device = rank_device(rank, dist.get_backend())
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    model = _shard(_make_model(shape, device), mesh, "before", True, False)
    _train(model, shape, [rank], 1, device)
    sd = model.state_dict()
    assert all(type(v.to_local()) is torch.Tensor for v in sd.values()), "state_dict must hold plain shards"
    dcp.save(sd, checkpoint_id=os.path.join(path, "dcp"))
    trained = {n: _full(p.detach()) for n, p in model.named_parameters()}
    # Loading back under FSDP2 restores the values into the FP8-gathered parameters.
    fresh = _shard(_make_model(shape, device), mesh, "before", True, False)
    fresh_sd = fresh.state_dict()
    dcp.load(fresh_sd, checkpoint_id=os.path.join(path, "dcp"))
    for n, p in fresh.named_parameters():
        assert torch.equal(_full(p.detach()), trained[n]), n
    x, counts = _batch(shape, rank, 0, device)
    fresh_out = fresh(x, counts)
    assert torch.equal(fresh_out, model(x, counts))
    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(os.path.join(path, "dcp"), os.path.join(path, "model.pt"))
        single = ops.convert_to_fp8(_make_model(shape, device))
        single.load_state_dict(torch.load(os.path.join(path, "model.pt")))
        for n, p in single.named_parameters():
            assert torch.equal(p.detach(), trained[n]), n
        assert torch.equal(single(x, counts), fresh_out)
    dist.barrier()


def _worker_wgrad_accumulation(rank: int, world: int, shape: dict) -> None:
    """``wgrad_accumulation`` under FSDP2: with ``"grad"`` the wgrad GEMM adds two micro-batches into the
    unsharded ``.grad`` (``set_requires_gradient_sync(False)`` for the first): the reduce-scattered
    gradients are those of ``"off"`` (autograd's add) within the bf16 roundings that differ (the GEMM
    rounds the fp32 sum once); ``"main_grad"`` raises (it would bypass the reduce-scatter)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = rank_device(rank, dist.get_backend())
    mesh = init_device_mesh(device.type, (world,))

    def sharded(target: str) -> Model:
        model = _make_model(shape, device)
        options = ops.RowwiseOptions(wgrad_accumulation=target)
        ops.convert_to_fp8(model, ops.Fp8Recipe(wgrad_precision="fp8", options=options))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    grads = {}
    for target in ("off", "grad"):
        model = sharded(target)
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, counts = _batch(shape, rank, micro, device)
            _loss(model(x, counts)).backward()
        grads[target] = {n: _full(p.grad) for n, p in model.named_parameters()}
    for name, off in grads["off"].items():
        # Elementwise within two bf16 roundings, and where the two micro-batches cancel, within a rounding of
        # the gradient's scale.
        scale = off.float().abs().max().item()
        torch.testing.assert_close(
            grads["grad"][name].float(), off.float(), rtol=2**-6, atol=scale * 2**-8, msg=lambda m: f"{name}: {m}"
        )
        assert not torch.equal(grads["grad"][name], torch.zeros_like(off)), name
    # The GEMM's single rounding shows somewhere: the in-place path ran (not autograd's add).
    assert any(not torch.equal(grads["grad"][n], grads["off"][n]) for n in grads["off"])
    x, counts = _batch(shape, rank, 0, device)
    with pytest.raises(ValueError, match="'main_grad' does not work under FSDP2"):
        sharded("main_grad")(x, counts)
    dist.barrier()


def _spawn(fn, world: int, backend: str, *args: object) -> None:
    """``fn(rank, world, *args)`` in ``world`` processes of one ``backend`` process group (``tests.support``)."""
    run_distributed(fn, world, *args, backend=backend, timeout_s=COLLECTIVE_TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S)


# (order, fp8_all_gather, activation checkpointing, compiled blocks)
EAGER_CASES = [
    ("before", False, False, False),
    ("before", True, False, False),
    ("after", False, False, False),
    ("after-per-block", False, False, False),
    ("before", True, True, False),
]
COMPILED_CASES = [("before", False, False, True), ("before", True, False, True), ("after", False, False, True)]


# (order, fp8_dispatch, fp8_all_gather)
EXPERT_PARALLEL_CASES = [
    ("before", True, False),
    ("before", True, True),
    ("before", False, True),
    ("after", False, False),
]


def _gpus_or_skip(world: int) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")


@gloo_cpu_only
def test_fsdp_training_matches_unsharded():
    _spawn(_worker_training, 2, "gloo", EAGER_CASES, CPU_SHAPE)


@gloo_cpu_only
def test_fsdp_compiled_blocks():
    _spawn(_worker_training, 2, "gloo", COMPILED_CASES, CPU_SHAPE)


@gloo_cpu_only
def test_fsdp_checkpoint_loads_unsharded(tmp_path):
    _spawn(_worker_checkpoint, 2, "gloo", CPU_SHAPE, str(tmp_path))


@gloo_cpu_only
def test_fsdp_wgrad_accumulation():
    _spawn(_worker_wgrad_accumulation, 2, "gloo", CPU_SHAPE)


@gloo_cpu_only
def test_fsdp_with_expert_parallel():
    _spawn(_worker_expert_parallel, 4, "gloo", EXPERT_PARALLEL_CASES, CPU_SHAPE)


@pytest.mark.cuda
def test_fsdp_gpu_with_expert_parallel():
    _gpus_or_skip(4)
    _spawn(_worker_expert_parallel, 4, "nccl", EXPERT_PARALLEL_CASES, GPU_SHAPE)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_gpu_training(world):
    _gpus_or_skip(world)
    _spawn(_worker_training, world, "nccl", EAGER_CASES, GPU_SHAPE)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_gpu_compiled_blocks(world):
    _gpus_or_skip(world)
    _spawn(_worker_training, world, "nccl", COMPILED_CASES, GPU_SHAPE)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_gpu_checkpoint(world, tmp_path):
    _gpus_or_skip(world)
    _spawn(_worker_checkpoint, world, "nccl", GPU_SHAPE, str(tmp_path))


def test_enable_fp8_all_gather_refusals():
    model = _make_model(CPU_SHAPE, torch.device("cpu"))
    with pytest.raises(ValueError, match="no FP8 expert module"):
        ops.enable_fp8_all_gather(model)
    ops.convert_to_fp8(model, ops.Fp8Recipe(name="blockwise"))
    with pytest.raises(ValueError, match="rowwise recipe"):
        ops.enable_fp8_all_gather(model)


def test_convert_in_place_keeps_module_and_parameters():
    model = _make_model(CPU_SHAPE, torch.device("cpu"))
    experts = model.layers[0].experts
    params = list(experts.parameters())
    assert ops.convert_to_fp8(model) is model
    assert model.layers[0].experts is experts and isinstance(experts, ops.Fp8GroupedExperts)
    assert all(a is b for a, b in zip(experts.parameters(), params))


@pytest.mark.parametrize(
    "recipe",
    [
        ops.Fp8Recipe(),
        ops.Fp8Recipe(save_fp8_weight=False),
        ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False)),
    ],
    ids=["default", "no-saved-fp8-weight", "no-fold-option"],
)
def test_prequantized_weight_matches_quantizing(recipe):
    """A weight given as ``Fp8WeightTensor`` (FP8-gathered) gives bitwise the grouped linear of its bf16 weight.

    Output, ``dx`` and ``dW`` against the bf16 weight quantized by the same recipe with
    the folded dgrad (the only dgrad a pre-quantized weight takes); ``dW`` is a plain tensor.
    """
    import kernels_helion
    from tests.support import DEVICE, offsets_from_sizes

    sizes, k, n = [5, 0, 19, 1], 32, 48
    x = torch.randn(sum(sizes) + 3, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device=DEVICE, dtype=torch.bfloat16)
    offs = offsets_from_sizes(sizes)
    grad = torch.randn(x.shape[0], n, device=DEVICE, dtype=torch.bfloat16)
    quant = (recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    q, scales = kernels_helion.quantize_rowwise_expert_weights(w, *quant)

    reference_recipe = ops.Fp8Recipe(save_fp8_weight=recipe.save_fp8_weight)  # folds dgrad
    x_ref, w_ref = x.clone().requires_grad_(), nn.Parameter(w.clone())
    out_ref = ops.fp8_grouped_linear(x_ref, w_ref, offs, reference_recipe)
    out_ref.backward(grad)

    x_pre, w_pre = x.clone().requires_grad_(), nn.Parameter(ops.Fp8WeightTensor(q, scales, w.dtype, quant))
    out = ops.fp8_grouped_linear(x_pre, w_pre, offs, recipe)
    out.backward(grad)
    assert torch.equal(out, out_ref)
    assert torch.equal(x_pre.grad, x_ref.grad)
    assert type(w_pre.grad) is torch.Tensor and torch.equal(w_pre.grad, w_ref.grad)


def test_prequantized_weight_restrided_is_its_dense_view():
    """``as_strided`` of an ``Fp8WeightTensor`` to its own layout keeps the FP8 parts; to other strides or
    another offset it is that view of the values (not the weight as it is)."""
    import kernels_helion
    from tests.support import DEVICE

    quant = (torch.float8_e4m3fn, False)
    w = torch.randn(2, 32, 32, device=DEVICE, dtype=torch.bfloat16)
    q, scales = kernels_helion.quantize_rowwise_expert_weights(w, *quant)
    weight = ops.Fp8WeightTensor(q, scales, torch.bfloat16, quant)
    dense = weight.dequantize()
    same = torch.as_strided(weight, weight.shape, weight.stride())
    assert type(same) is ops.Fp8WeightTensor
    transposed = torch.as_strided(weight, (2, 32, 32), (32 * 32, 1, 32))
    assert type(transposed) is torch.Tensor and torch.equal(transposed, dense.transpose(1, 2))
    second = torch.as_strided(weight, (1, 32, 32), (32 * 32, 32, 1), 32 * 32)
    assert torch.equal(second, dense[1:])


def test_prequantized_weight_views_keep_fp8_parts():
    """``w.transpose(-2, -1)`` and ``w.to(dtype)`` of an ``Fp8WeightTensor`` keep its FP8 parts (torchtitan's
    experts hand their GEMM seam ``w.bfloat16().transpose(-2, -1)``): ``fp8_grouped_mm`` on that view gives
    bitwise the grouped linear of the weight, and the gradient reaches the weight through both views."""
    import kernels_helion
    from tests.support import DEVICE, offsets_from_sizes

    sizes, k, n = [5, 0, 19, 1], 32, 48
    x = torch.randn(sum(sizes) + 3, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device=DEVICE, dtype=torch.bfloat16)
    offs = offsets_from_sizes(sizes)
    grad = torch.randn(x.shape[0], n, device=DEVICE, dtype=torch.bfloat16)
    quant = (torch.float8_e4m3fn, False)
    q, scales = kernels_helion.quantize_rowwise_expert_weights(w, *quant)
    weight = ops.Fp8WeightTensor(q, scales, torch.float32, quant)

    view = weight.bfloat16().transpose(-2, -1)
    assert type(view) is ops.Fp8WeightTensor and view.dtype == torch.bfloat16 and view.shape == (len(sizes), k, n)
    assert not view.is_contiguous() and view.transpose(1, 2).is_contiguous()
    assert torch.equal(view.dequantize(), weight.dequantize().bfloat16().transpose(1, 2))
    assert type(view + 0) is torch.Tensor and torch.equal(view + 0, view.dequantize())

    x_ref, w_ref = x.clone().requires_grad_(), nn.Parameter(ops.Fp8WeightTensor(q, scales, torch.bfloat16, quant))
    out_ref = ops.fp8_grouped_linear(x_ref, w_ref, offs)
    out_ref.backward(grad)
    x_seam, w_seam = x.clone().requires_grad_(), nn.Parameter(weight)
    out = ops.fp8_grouped_mm(x_seam, w_seam.bfloat16().transpose(-2, -1), offs)
    out.backward(grad)
    assert torch.equal(out, out_ref) and torch.equal(x_seam.grad, x_ref.grad)
    assert w_seam.grad.dtype == torch.float32 and torch.equal(w_seam.grad, w_ref.grad.float())
