"""Expert parallelism (EP): each rank of a process group holds ``E / ep`` experts and runs them on every rank's tokens.

    ops.convert_to_fp8(model)                               # optional, first
    ops.apply_expert_parallel(model, mesh, mesh_dim="ep", fp8_dispatch=True)

``apply_expert_parallel`` shards each experts module's ``w1``/``w2``/``w3`` along
``E`` (``DTensor``, ``Shard(0)`` on the EP mesh dimension, as torchtitan does) and
hooks an ``ExpertParallel`` dispatcher around its call ``experts(x_sorted,
num_tokens_per_expert)`` (rows sorted by global expert, counts of all ``E``
experts: torchtitan's MoE calls its experts so). ``ops.MoE`` calls
``experts(x, num_tokens_per_expert, tokens=TokenRows(...))`` instead: the token rows
and, for each sorted row, its token, so that the dispatch gathers each token's row
into the send buffer itself (no ``(T * k, dim)`` copy of ``x``; with FP8 dispatch each
token quantized once, not once per choice). Per call:

1. dispatch: the counts go to the ranks owning the experts (``all_to_all_single``
   of ``ep * (E / ep + 1)`` int64s, the extra one per rank flagging bad routing);
   one device-to-host copy brings the split sizes (and the flags) to the host;
   the rows go to their experts' ranks (``all_to_all_single`` with those splits);
   received rows, source-rank-major, are reordered expert-major (local expert 0
   from every source rank in rank order, then expert 1, ...) by a gather whose
   indices are computed on the device;
2. the local experts run: ``experts(x_local, num_tokens_per_local_expert)``;
3. return: the inverse gather, and the rows go back (``all_to_all_single`` with
   the splits swapped), in the order the caller sorted them.

Backward runs the same exchanges in reverse with the same split sizes.

**Host syncs: exactly one device-to-host copy per layer per forward** (the split
sizes ``all_to_all_single`` needs on the host, read by one ``.tolist()``); the
backward reuses them and has none. ``tests/test_expert_parallel.py`` measures this
with ``torch.cuda.set_sync_debug_mode``.

**The capacity mode** (``capacity=C``) has none: every rank sends ``C`` rows to every
rank (``ops.ep_layout``: its first ``C`` rows for that rank, then filler), the experts
get ``ep * C`` rows with the filler past ``offs[-1]``, and a rank's rows past ``C``
for one rank are dropped and reported (``ops.ep_overflow``: raised at the next call
on every rank, or counted). A whole layer step can then be captured in a CUDA graph.

**What travels** (``K = dim``, ``R`` routed rows): forward dispatch, bf16 rows
(``2K`` bytes a row), or with ``fp8_dispatch`` each row quantized rowwise before the
exchange (the FP8 experts' recipe: ``K`` FP8 bytes + its 4-byte float32 scale, in
two all-to-alls, the rows and the scales: packing them into one ``K + 4``-byte row
costs a copy of every row on each side, more than the second collective's latency).
The experts' forward GEMMs read those FP8 rows as they are and their wgrad builds
``x^T`` from them: rowwise scales are per token, so quantizing before the exchange
gives bitwise the same operand as quantizing the received bf16 rows after it.
Forward return: the experts' bf16 outputs. Backward: bf16 gradients both ways (the
dispatch's gradient is the experts' ``dx`` of the received rows; quantization is
straight through, as in the FP8 linear): they feed the bf16 parts of the network
(router, attention) unquantized.

**No padding**: token groups of any size (0 included) go to the experts as they are.

**Bad input**, checked before any collective where it can be seen locally:
EP group missing, not initialized, or without this rank; experts modules that
cannot take FP8 rows under ``fp8_dispatch``; per call, an experts module whose
local expert count is not ``E / ep`` and counts of the wrong length.
``apply_expert_parallel`` compares the experts' configuration (``E``, ``dim``,
``hidden``, ``fp8_dispatch``) across the ranks with one ``all_gather`` at set-up
(a mismatch would make the exchanges' sizes disagree, which no rank can see
alone) and then checks that ``E`` divides by the EP size: both raise the same
error on every rank, so that a rank that alone sees a problem does not leave
the others waiting in a collective.
Routing indices out of ``[0, E)`` and a row count different from the counts'
sum need the values: they are flagged on the device, the flags travel with the
counts, and after the one host copy every rank raises the same ``ValueError``
before the rows are exchanged (no hang, no extra sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kernels_helion.fp8_format import FP8_DTYPES
from ops.ep_layout import TokenRows, capacity_receive, capacity_send, exact_receive_order, inverse_permutation
from ops.ep_overflow import ON_OVERFLOW, OverflowMonitor, OverflowTotals
from ops.experts import EXPERT_WEIGHTS, expert_weights, is_experts
from ops.modules import Fp8GroupedExperts, local_tensor
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe
from ops.row_gather import gather_rows, sum_pair_rows

# Called with (name, bytes, start, end) after each all-to-all of the rows when set (benchmarks):
# name is "dispatch", "return", "dispatch_grad" or "return_grad", bytes those this rank sends
# (to itself included), start/end CUDA events recorded around it (on CPU: time.perf_counter() values).
CommRecorder = Callable[[str, int, object, object], None]


def _ep_group(mesh_or_group: object, mesh_dim: str | int | None) -> tuple[dist.ProcessGroup, DeviceMesh | None]:
    """The EP process group (and the 1-D mesh, if given a mesh) of ``mesh_or_group``; checks membership."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialized: call dist.init_process_group first")
    mesh = None
    if mesh_or_group == dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns to the ranks it leaves out
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the EP group")
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim > 1 and mesh_dim is None:
            raise ValueError(f"mesh_dim must name the EP dimension of a {mesh_or_group.ndim}-D DeviceMesh")
        if mesh_dim is None:
            mesh = mesh_or_group
        elif isinstance(mesh_dim, str):
            mesh = mesh_or_group[mesh_dim]
        else:
            raise TypeError(f"mesh_dim must be the name of a mesh dimension (str), got {mesh_dim!r}")
        group = mesh.get_group()
    elif isinstance(mesh_or_group, dist.ProcessGroup):
        if mesh_dim is not None:
            raise ValueError("mesh_dim applies to a DeviceMesh, not to a ProcessGroup")
        group = mesh_or_group
    else:
        raise TypeError(
            f"the EP group must be a torch.distributed ProcessGroup or DeviceMesh, got {type(mesh_or_group).__name__}"
        )
    if group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the EP group")
    return group, mesh


def _all_to_all_rows(
    t: Tensor, out_splits: list[int], in_splits: list[int], group, record=None, zero_row: bool = False
) -> Tensor:
    """``dist.all_to_all_single`` of the rows of ``t`` (sent as bytes: any dtype, 1-D tensors as rows of one).

    With ``zero_row`` the result has one more row, of zeros, after the received ones.
    """
    t = t.contiguous()
    row_bytes = t.shape[1:].numel() * t.element_size()
    rows = t.view(torch.uint8).view(t.shape[0], row_bytes)
    received = sum(out_splits)
    out = t.new_empty((received + zero_row, *t.shape[1:]))  # returned as it is: not a view (FSDP2 warns of those)
    out_rows = out.view(torch.uint8).view(out.shape[0], row_bytes)
    if zero_row:
        out_rows[received:].zero_()
        out_rows = out_rows[:received]
    if record is None:
        dist.all_to_all_single(out_rows, rows, out_splits, in_splits, group=group)
    else:
        record(lambda: dist.all_to_all_single(out_rows, rows, out_splits, in_splits, group=group), rows.numel())
    return out


@dataclass
class DispatchPlan:
    """One call's exchange: split sizes (host), the expert-major gather (device), the comm recorder.

    With ``pack`` (capacity layout, ``ops.ep_layout``), ``send`` first fills the fixed
    slots from the caller's rows and ``send_back`` takes each kept row's result from its
    slot, 0 for dropped rows (a zero row past the slots).
    """

    group: dist.ProcessGroup
    send_splits: list[int]  # rows this rank sends to each rank
    recv_splits: list[int]  # rows this rank receives from each rank
    expert_major: Tensor  # (R,) received position (source-rank-major) of each expert-major row
    source_major: Tensor  # (R,) its inverse
    recorder: CommRecorder | None = field(default=None, repr=False)
    pack: Tensor | None = None  # capacity layout: the caller's row sent in each slot
    unpack: Tensor | None = None  # capacity layout: the slot each of the caller's rows comes back in (or ep * C)

    def record(self, name: str):
        if self.recorder is None:
            return None
        recorder = self.recorder

        def timed(run: Callable[[], object], nbytes: int) -> None:
            if self.expert_major.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
            else:
                start = time.perf_counter()
                run()
                end = time.perf_counter()
            recorder(name, nbytes, start, end)

        return timed

    def send(self, t: Tensor, name: str, rows: Tensor | None = None) -> Tensor:
        """The caller's rows to their ranks; ``rows``: the row of ``t`` that is each caller's row (token rows)."""
        if self.pack is None:
            index = rows
        elif rows is None or not rows.shape[0]:  # no rows: the slots are filler (zeros below)
            index = self.pack
        else:
            index = rows[self.pack]
        if index is not None:
            t = gather_rows(t, index) if t.shape[0] else t.new_zeros((index.shape[0], *t.shape[1:]))
        return _all_to_all_rows(t, self.recv_splits, self.send_splits, self.group, self.record(name))

    def send_back(self, t: Tensor, name: str) -> Tensor:
        if self.unpack is None:
            return _all_to_all_rows(t, self.send_splits, self.recv_splits, self.group, self.record(name))
        # Dropped rows read the zero row past the slots.
        out = _all_to_all_rows(t, self.send_splits, self.recv_splits, self.group, self.record(name), zero_row=True)
        return gather_rows(out, self.unpack)


def _rows_gradient(plan: DispatchPlan, grad: Tensor, name: str, tokens: TokenRows | None) -> Tensor:
    """The gradient of the caller's rows (or of their tokens) from the experts' gradient ``grad`` (expert-major)."""
    rows = plan.send_back(gather_rows(grad.contiguous(), plan.source_major), name)
    return rows if tokens is None else sum_pair_rows(rows, tokens.pairs)


class _Dispatch(torch.autograd.Function):
    """bf16 rows to their experts' ranks, expert-major; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: DispatchPlan, tokens: TokenRows | None) -> Tensor:
        ctx.plan, ctx.tokens = plan, tokens
        return gather_rows(plan.send(x, "dispatch", None if tokens is None else tokens.token), plan.expert_major)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _rows_gradient(ctx.plan, grad, "dispatch_grad", ctx.tokens), None, None


class _QuantizedDispatch(torch.autograd.Function):
    """Rows quantized rowwise, then sent as ``K + 4`` bytes (FP8 values, float32 scale) each, in two all-to-alls.

    With ``tokens``, ``x`` holds token rows: each token is quantized once (a rowwise
    scale is per row, so its FP8 row is bitwise that of each of its copies) and its FP8
    row gathered into the send buffer once per choice.
    Returns ``(anchor, data, scales)``: ``data``/``scales`` the received FP8 rows and
    scales, expert-major; ``anchor`` a stride-0 ``(R, K)`` tensor of ``x``'s dtype
    that carries no values, only the gradient: the experts' ``dx`` of the received rows
    (straight-through quantization), sent back as it is.
    """

    @staticmethod
    def forward(ctx, x: Tensor, plan: DispatchPlan, float8_dtype: torch.dtype, pow2: bool, tokens: TokenRows | None):
        ctx.plan, ctx.tokens = plan, tokens
        k = x.shape[1]
        rows = None if tokens is None else tokens.token
        data, scales = kernel_ops.quantize_rowwise_rows(x.contiguous(), float8_dtype, pow2)
        data = gather_rows(plan.send(data, "dispatch", rows), plan.expert_major)
        scales = plan.send(scales.view(-1), "dispatch", rows).index_select(0, plan.expert_major)
        anchor = x.new_zeros(()).expand(data.shape[0], k)
        ctx.mark_non_differentiable(data, scales)
        return anchor, data, scales

    @staticmethod
    def backward(ctx, grad: Tensor, *_: object) -> tuple[Tensor, None, None, None, None]:
        return _rows_gradient(ctx.plan, grad, "dispatch_grad", ctx.tokens), None, None, None, None


class _Return(torch.autograd.Function):
    """The experts' rows back to the ranks (and order) they came from; backward dispatches the gradients."""

    @staticmethod
    def forward(ctx, y: Tensor, plan: DispatchPlan) -> Tensor:
        ctx.plan = plan
        return plan.send_back(gather_rows(y, plan.source_major), "return")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        plan = ctx.plan
        return gather_rows(plan.send(grad, "return_grad"), plan.expert_major), None


_FP8_DISPATCH_NEEDS = (
    "fp8_dispatch needs ops.Fp8GroupedExperts whose recipe takes pre-quantized rows (convert_to_fp8 first; "
    "Fp8Recipe.takes_prequantized_rows: the rowwise recipe with fold_wgrad_input_scales=True, "
    "save_fp8_input=True and wgrad_precision other than 'bf16', as the wgrad's x^T is built from the "
    "dispatched FP8 rows)"
)


def _fp8_dispatch_recipe(experts: nn.Module) -> Fp8Recipe:
    """The recipe that quantizes the rows dispatched in FP8 to ``experts``: their own; raises if they cannot take them."""
    recipe = getattr(experts, "recipe", None)
    if not isinstance(experts, Fp8GroupedExperts) or not recipe.takes_prequantized_rows:
        with_recipe = f" with recipe {recipe.name!r}, options {recipe.options}" if isinstance(recipe, Fp8Recipe) else ""
        raise ValueError(f"{_FP8_DISPATCH_NEEDS}, got {type(experts).__name__}{with_recipe}")
    return recipe


def _row_quantization(recipe: Fp8Recipe) -> tuple[torch.dtype, bool]:
    """How ``recipe`` quantizes a row: ``(float8_dtype, round_scales_to_power_of_2)``."""
    return recipe.float8_dtype, recipe.round_scales_to_power_of_2


def _row_quantization_config(experts: nn.Module | None) -> dict[str, int]:
    """Whether ``experts`` take FP8 rows and how their recipe quantizes a row, as numbers (-1: not
    applicable) for ``_check_same_everywhere``: the same keys whatever the experts."""
    recipe = getattr(experts, "recipe", None)
    takes = isinstance(experts, Fp8GroupedExperts) and isinstance(recipe, Fp8Recipe) and recipe.takes_prequantized_rows
    dtype, pow2 = _row_quantization(recipe) if takes else (None, None)
    return {
        "takes_fp8_rows": int(takes),
        "row_float8_dtype": FP8_DTYPES.index(dtype) if takes else -1,
        "row_scales_power_of_2": int(pow2) if takes else -1,
    }


def _check_capacity(capacity: int | None, on_overflow: str) -> None:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be None or a positive int (rows per pair of EP ranks), got {capacity!r}")
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")


class ExpertParallel:
    """The dispatch and return of one experts module's rows over an EP process group (see the module docstring).

    Installed by ``apply_expert_parallel`` as forward hooks of the experts module;
    ``dispatch`` and ``return_rows`` are public for tests and custom layers.

    Args:
        group: the EP process group (``ep`` ranks).
        num_experts: ``E``, the layer's global expert count (a multiple of ``ep``).
        fp8_dispatch: send FP8 rows (rowwise, with ``recipe``) instead of bf16.
        recipe: the FP8 experts' ``ops.Fp8Recipe``, which quantizes the dispatched rows
            (needed with ``fp8_dispatch``: one with ``takes_prequantized_rows``).
        capacity: ``None``: exact split sizes, read on the host (one sync per call).
            An int ``C``: the no-sync mode, every rank sends ``C`` rows to every rank
            (rows past ``C`` for one rank are dropped, see ``on_overflow``).
        on_overflow: with ``capacity``, ``"raise"`` (the next call raises
            ``CapacityOverflowError``) or ``"drop"`` (dropped rows counted, ``overflow()``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        fp8_dispatch: bool = False,
        recipe: Fp8Recipe | None = None,
        capacity: int | None = None,
        on_overflow: str = "raise",
    ) -> None:
        if fp8_dispatch and not (isinstance(recipe, Fp8Recipe) and recipe.takes_prequantized_rows):
            raise ValueError(f"{_FP8_DISPATCH_NEEDS}, got recipe {recipe!r}")
        _check_capacity(capacity, on_overflow)
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(f"the expert count E={num_experts} must be divisible by the EP size {self.ep}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        self.fp8_dispatch = fp8_dispatch
        self.recipe = recipe
        self.capacity = capacity
        self.monitor = None if capacity is None else OverflowMonitor(capacity, num_experts, on_overflow)
        self.recorder: CommRecorder | None = None
        self._plans: list[DispatchPlan] = []

    def plan(self, rows: int, num_tokens_per_expert: Tensor) -> tuple[DispatchPlan, Tensor]:
        """Exchange the counts of the caller's ``rows`` rows; returns the plan and the rows per local expert ``(L,)``.

        Exact layout: the one device-to-host copy of the layer's forward happens here.
        Capacity layout: none; what the previous call dropped is reported here first.
        """
        if not isinstance(num_tokens_per_expert, Tensor) or num_tokens_per_expert.shape != (self.num_experts,):
            raise ValueError(
                f"num_tokens_per_expert must have shape ({self.num_experts},) (one count per global expert), "
                f"got {getattr(num_tokens_per_expert, 'shape', type(num_tokens_per_expert).__name__)}"
            )
        # A forward run inside a backward pass is activation checkpointing's recomputation of a call
        # already made: its rows were counted, and the previous call checked, the first time.
        recomputed = torch._C._current_graph_task_id() != -1
        if self.monitor is not None and not recomputed:
            self.monitor.before_call()
        counts = num_tokens_per_expert.to(torch.int64).view(self.ep, self.local_experts)
        # Negative counts are bad input: they are taken as 0 for the layout (no index out of bounds on
        # any rank) and their rows reported with the uncounted ones below, as every rank sees them.
        negative = (-counts).clamp_min(0).sum()
        counts = counts.clamp_min(0)
        # Beside the counts, to every rank: rows that the counts do not cover (pairs routed outside
        # [0, E), which ops.sort_by_expert leaves uncounted past the counted rows, a row count that
        # differs from the counts' sum, negative counts); in the capacity layout also ops.ep_overflow's numbers.
        uncounted = (rows - counts.sum()).abs() + negative
        if self.capacity is None:
            flags = uncounted.view(1)
        else:
            send = capacity_send(counts, rows, self.capacity)
            flags = torch.stack([send.dropped, uncounted, counts.sum(1).max()])  # ops.ep_overflow's columns
        message = torch.cat([counts, flags.view(1, -1).expand(self.ep, -1)], dim=1)
        received = torch.empty_like(message)
        dist.all_to_all_single(received, message, group=self.group)
        recv_counts = received[:, : self.local_experts]
        if self.capacity is not None:
            if not recomputed:
                self.monitor.add(received[:, self.local_experts :])
            receive = capacity_receive(recv_counts, self.capacity)
            splits = [self.capacity] * self.ep
            plan = DispatchPlan(
                self.group, splits, splits, receive.expert_major, receive.source_major, self.recorder,
                send.pack, send.unpack,
            )
            return plan, receive.local_counts
        host = torch.cat([counts.sum(1), recv_counts.sum(1), received[:, -1]]).tolist()  # the one host sync
        send_splits, recv_splits, bad = host[: self.ep], host[self.ep : 2 * self.ep], host[2 * self.ep :]
        if any(bad):
            raise ValueError(
                "routing: rows not covered by num_tokens_per_expert (top-k indices outside [0, "
                f"{self.num_experts}), rows and counts that differ, or negative counts) on EP ranks "
                f"{[r for r, b in enumerate(bad) if b]} ({[b for b in bad if b]} rows)"
            )
        expert_major = exact_receive_order(recv_counts, sum(recv_splits))
        plan = DispatchPlan(
            self.group, send_splits, recv_splits, expert_major, inverse_permutation(expert_major), self.recorder
        )
        return plan, recv_counts.sum(0)

    def overflow(self) -> OverflowTotals:
        """Capacity mode: rows dropped and the most rows one rank had for one rank, since set-up or the last
        raise (a host sync). Raises ``ValueError`` in the exact mode, which drops nothing."""
        if self.monitor is None:
            raise ValueError("overflow() applies to the capacity mode (capacity=C); the exact mode drops no rows")
        return self.monitor.read()

    def check_overflow(self) -> OverflowTotals:
        """Capacity mode: ``overflow()``, raising ``CapacityOverflowError`` (or ``ValueError`` for misrouted rows)
        at once if any row was dropped; the explicit check under CUDA graphs. It changes nothing: a rank
        may check alone, and the next call's check still runs on every rank alike."""
        if self.monitor is None:
            raise ValueError("check_overflow() applies to the capacity mode (capacity=C)")
        return self.monitor.check()

    def dispatch(
        self, x_sorted: Tensor, num_tokens_per_expert: Tensor, tokens: TokenRows | None = None
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None, DispatchPlan]:
        """``(x_local, num_tokens_per_local_expert, x_fp8, plan)``: this rank's experts' rows, expert-major.

        ``x_sorted``: the rows sorted by expert, or with ``tokens`` the token rows they are read
        from (``TokenRows``). bf16 dispatch: ``x_local`` the received rows, ``x_fp8`` ``None``.
        FP8 dispatch: ``x_fp8 = (data, scales)`` the received FP8 rows and ``x_local`` their
        gradient anchor.
        """
        rows = x_sorted.shape[0] if tokens is None else tokens.token.shape[0]
        plan, local_counts = self.plan(rows, num_tokens_per_expert)
        if not self.fp8_dispatch:
            return _Dispatch.apply(x_sorted, plan, tokens), local_counts, None, plan
        anchor, data, scales = _QuantizedDispatch.apply(x_sorted, plan, *_row_quantization(self.recipe), tokens)
        return anchor, local_counts, (data, scales), plan

    @staticmethod
    def return_rows(y_local: Tensor, plan: DispatchPlan) -> Tensor:
        """The experts' output rows back to their source ranks, in the callers' sorted order."""
        return _Return.apply(y_local, plan)

    def check_experts(self, experts: nn.Module, sharded: bool = True) -> None:
        """Raise unless ``experts`` holds ``E / ep`` experts here (``E`` unless ``sharded``) and takes FP8
        rows (with ``fp8_dispatch``)."""
        w1 = getattr(experts, "w1", None)
        expected = self.local_experts if sharded else self.num_experts
        if isinstance(w1, Tensor) and local_tensor(w1).shape[0] != expected:
            raise ValueError(
                f"the experts module holds {local_tensor(w1).shape[0]} experts on this rank; expert parallelism "
                f"over {self.ep} ranks of E={self.num_experts} needs {expected}"
                + (" (w1 sharded along E)" if sharded else " before sharding")
            )
        if self.fp8_dispatch:
            recipe = _fp8_dispatch_recipe(experts)
            if _row_quantization(recipe) != _row_quantization(self.recipe):
                raise ValueError(
                    f"the experts' recipe quantizes rows as (float8_dtype, round_scales_to_power_of_2) = "
                    f"{_row_quantization(recipe)}, but this ExpertParallel dispatches rows quantized as "
                    f"{_row_quantization(self.recipe)}: build it with the experts' recipe"
                )

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tokens = kwargs.get("tokens")
        if len(args) != 2 or set(kwargs) - {"tokens"} or not isinstance(tokens, (TokenRows, type(None))):
            raise TypeError(
                "an expert-parallel experts module is called as experts(x_sorted, num_tokens_per_expert) "
                "or experts(x, num_tokens_per_expert, tokens=TokenRows(...))"
            )
        self.check_experts(module)
        x_local, local_counts, x_fp8, plan = self.dispatch(*args, tokens=tokens)
        self._plans.append(plan)
        return (x_local, local_counts), ({} if x_fp8 is None else {"x_fp8": x_fp8})

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Tensor:
        return self.return_rows(output, self._plans.pop())

    def attach(self, experts: nn.Module) -> None:
        """Install the dispatch and return hooks on ``experts`` (``ops.convert_to_fp8`` converts in place, so they stay)."""
        self.check_experts(experts)
        experts.register_forward_pre_hook(self.pre_hook, with_kwargs=True)
        experts.register_forward_hook(self.post_hook, with_kwargs=True)
        experts.expert_parallel = self


def _check_same_everywhere(group: dist.ProcessGroup, device: torch.device, config: dict[str, int]) -> None:
    """One ``all_gather`` of ``config`` over the group; the same ``ValueError`` on every rank if they differ."""
    mine = torch.tensor(list(config.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = [t.tolist() for t in gathered]
    if any(row != table[0] for row in table):
        rows = "; ".join(f"rank {r}: {dict(zip(config, row))}" for r, row in enumerate(table))
        raise ValueError(f"expert parallelism needs the same experts configuration on every EP rank, got {rows}")


def apply_expert_parallel(
    model: nn.Module,
    mesh_or_group: DeviceMesh | dist.ProcessGroup,
    *,
    mesh_dim: str | None = None,
    fp8_dispatch: bool = False,
    capacity: int | None = None,
    on_overflow: str = "raise",
) -> list[ExpertParallel]:
    """Shard every experts module of ``model`` over the EP group and hook its dispatch; returns the dispatchers.

    Experts modules: ``ops.GroupedExperts`` / ``ops.Fp8GroupedExperts`` and
    torchtitan-style experts (3-D ``w1 (E, H, D)``, ``w2 (E, D, H)``, ``w3 (E, H, D)``
    parameters, called as ``experts(x_sorted, num_tokens_per_expert)`` with rows sorted by
    global expert). Their weights become ``DTensor`` parameters ``Shard(0)`` on the EP
    mesh (rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)``; the values are
    taken from rank 0's, as ``distribute_tensor`` does), which our modules use through
    ``to_local()``; a torchtitan-style module must do the same (torchtitan's does).

    Args:
        model: a model or an experts module; changed in place.
        mesh_or_group: a ``DeviceMesh`` (``mesh_dim`` names the EP dimension of a
            multi-dimensional one) or an EP ``ProcessGroup``.
        mesh_dim: the EP dimension's name in ``mesh_or_group``.
        fp8_dispatch: send tokens as FP8 rows (``ops.Fp8GroupedExperts`` with the
            rowwise recipe only: call ``ops.convert_to_fp8`` first).
        capacity: ``None`` (exact split sizes, one host sync per call) or the no-sync
            mode's rows per (source, destination) pair of EP ranks per call: every rank
            sends ``capacity`` rows to every rank, the experts get ``ep * capacity`` rows.
            The same on every rank.
        on_overflow: with ``capacity``, ``"raise"`` or ``"drop"`` (``ops.ep_overflow``).

    Set-up runs one ``all_gather`` per experts module over the EP group (the
    configuration check); a ``ProcessGroup`` is wrapped in a ``DeviceMesh``
    (``DeviceMesh.from_group``) for the ``DTensor`` placement.
    """
    group, mesh = _ep_group(mesh_or_group, mesh_dim)
    if not isinstance(fp8_dispatch, bool):
        raise TypeError(f"fp8_dispatch must be a bool, got {fp8_dispatch!r}")
    _check_capacity(capacity, on_overflow)
    found = [m for m in model.modules() if is_experts(m)]
    if not found:
        raise ValueError("model holds no experts module (3-D w1/w2/w3 parameters)")
    dispatchers = []
    for experts in found:
        if getattr(experts, "expert_parallel", None) is not None:
            raise ValueError("an experts module of model already has expert parallelism applied")
        weights = expert_weights(experts)
        if any(isinstance(w, DTensor) for w in weights):
            raise ValueError("the experts' weights are DTensors already; apply expert parallelism to plain weights")
        if any(type(w.data) is not torch.Tensor for w in weights):
            raise ValueError(
                f"the experts' weights are {type(weights[0].data).__name__}s: apply expert parallelism before "
                "ops.enable_fp8_all_gather (which then wraps each rank's local experts)"
            )
        num_experts = weights[0].shape[0]
        device = weights[0].device
        _check_same_everywhere(
            group,
            torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device,
            {
                "E": num_experts,
                "dim": weights[0].shape[2],
                "hidden": weights[0].shape[1],
                "fp8_dispatch": fp8_dispatch,
                "capacity": capacity or 0,
                "on_overflow": ON_OVERFLOW.index(on_overflow),
                # What the checks after the gather read, so that they pass or fail on every rank alike.
                **_row_quantization_config(experts if fp8_dispatch else None),
            },
        )
        recipe = _fp8_dispatch_recipe(experts) if fp8_dispatch else getattr(experts, "recipe", None)
        dispatcher = ExpertParallel(group, num_experts, fp8_dispatch, recipe, capacity, on_overflow)
        dispatcher.check_experts(experts, sharded=False)
        if mesh is None:
            mesh = DeviceMesh.from_group(group, device.type)
        for name, w in zip(EXPERT_WEIGHTS, weights):
            sharded = distribute_tensor(w.detach(), mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded, requires_grad=w.requires_grad))
        dispatcher.attach(experts)
        dispatchers.append(dispatcher)
    return dispatchers
