"""How launchers run a Helion kernel: with a chosen config, never an implicit search."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence

import helion
import helion.language as hl
import torch
from helion.autotuner.config_spec import MemoryOpFact
from helion.runtime import default_launcher
from helion.runtime.kernel import BoundKernel
from triton import knobs
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

from autotune_cache import current_arch

_bound_kernels: dict[Hashable, BoundKernel] = {}


def on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the CPU, where kernels run in Triton's interpreter."""
    return t.is_cpu  # 8x cheaper than ``t.device.type == "cpu"``: launchers ask on every call


def has_tma(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU with TMA (Hopper on), for a launcher that would use descriptors."""
    if device.type != "cuda":
        return False
    arch = current_arch()
    return arch.startswith("sm") and int(arch[2:]) >= 90


def require_interpreter_on_cpu(t: torch.Tensor) -> None:
    """Raise if a CPU tensor reaches a kernel while Triton's interpreter is off."""
    if on_cpu(t) and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Helion kernels run on CPU tensors only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing kernels_helion"
        )


def bind_kernel(kernel: helion.Kernel, args: tuple[object, ...]) -> BoundKernel:
    """The kernel bound to (specialized for) ``args``, cached: its config space and compiled configs."""
    # Helion's shape bucketing maps sizes 1 and >= 2 to one key but bakes a
    # size of 1 into code traced from such a call; keying on which sizes are 1
    # keeps such code away from calls with larger sizes.
    size_one = tuple(
        tuple(s == 1 for s in a.shape) for a in args if isinstance(a, torch.Tensor)
    )
    key = (id(kernel), kernel._base_specialization_key(args), size_one)
    bound = _bound_kernels.get(key)
    if bound is None:
        bound = _bound_kernels[key] = BoundKernel(kernel, args)
    return bound


# Helion's control-flow ops and the arguments of theirs that name the graphs they run, in the
# order the code generator emits those graphs.
_SUBGRAPH_ARGS = {"_for_loop": (0,), "_for_loop_step": (0,), "_while_loop": (0, 1), "_if": (1, 2)}


def indexing_slots(bound: BoundKernel) -> list[MemoryOpFact] | None:
    """The kernel's loads and stores in the order its generated code takes ``Config.indexing`` slots in.

    Helion lists them (``config_spec.memory_op_facts``) graph by graph, inner
    loop bodies first, while its code generator numbers them as it emits them:
    the root graph in order, each loop or branch body where it is called. The two
    orders differ when memory ops sit at several loop depths (the grouped GEMMs:
    the list starts with the K loop's operand loads, the code with ``offs``).
    ``None`` when the walk does not account for every listed op.
    """
    facts = bound.config_spec.memory_op_facts
    pending: dict[object, list[MemoryOpFact]] = {}
    for fact in facts:
        pending.setdefault(fact.graph_id, []).append(fact)
    device_ir = bound.host_function.device_ir
    graphs = {info.graph_id: info.graph for info in device_ir.graphs}
    order: list[MemoryOpFact] = []

    def walk(graph_id: int) -> None:
        for node in graphs[graph_id].nodes:
            if node.op != "call_function":
                continue
            if node.target in (hl.load, hl.store):
                if pending.get(graph_id):
                    order.append(pending[graph_id].pop(0))
                continue
            for position in _SUBGRAPH_ARGS.get(getattr(node.target, "__name__", ""), ()):
                sub = node.args[position] if position < len(node.args) else None
                if isinstance(sub, int) and sub in graphs:
                    walk(sub)

    for root in device_ir.root_ids:
        walk(root)
    return order if len(order) == len(facts) else None


# id(config) -> (config, its first block size, the config without it): made once per config
# object, as ``launch``'s fast path is keyed on the config's identity.
_leading_block_configs: dict[int, tuple[helion.Config, int, helion.Config]] = {}


def split_leading_block(config: helion.Config) -> tuple[int, helion.Config]:
    """``(block_sizes[0], config without it)``, for kernels that take their first tile size as a compile-time argument.

    Such a kernel's tiles start at rows computed on the device, or are reshaped by
    their size, so it takes that size as a constexpr; its configs (defaults, the
    autotune cache, the tuner) still name every tile size, the first one included.
    """
    entry = _leading_block_configs.get(id(config))
    if entry is None or entry[0] is not config:
        options = dict(config.config)
        first, *rest = options["block_sizes"]
        options["block_sizes"] = rest
        entry = _leading_block_configs[id(config)] = (config, first, helion.Config(**options))
    return entry[1], entry[2]


# (id(config), changes) -> (config, the config with the changes): see ``config_with``.
_changed_configs: dict[tuple[int, tuple[tuple[str, object], ...]], tuple[helion.Config, helion.Config]] = {}


def config_with(config: helion.Config, **changes: object) -> helion.Config:
    """``config`` with the options in ``changes`` replaced: the same object for the same ``config`` and changes.

    Launchers that adjust a selected config on every call use it, as ``launch``'s
    fast path is keyed on the config's identity: a new object per call would bind
    and look the kernel up again each time (hundreds of microseconds of host time).
    """
    key = (id(config), tuple((name, _hashable(value)) for name, value in sorted(changes.items())))
    entry = _changed_configs.get(key)
    if entry is None or entry[0] is not config:
        entry = _changed_configs[key] = (config, helion.Config(**{**config.config, **changes}))
    return entry[1]


def _hashable(value: object) -> object:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


# (kernel, config, tensors, specialization) -> (config, the config with those tensors' memory
# ops through TMA): made once each, so that repeated calls hand ``launch`` the same object (its
# fast path is keyed on identity) without binding the kernel again.
_tma_configs: dict[tuple[object, ...], tuple[helion.Config, helion.Config]] = {}


def with_tma(
    kernel: helion.Kernel,
    args: tuple[object, ...],
    config: helion.Config,
    stores: tuple[str, ...] = (),
    loads: tuple[str, ...] = (),
    pointer_loads: tuple[str, ...] = (),
) -> helion.Config:
    """``config`` with the stores to the arguments named in ``stores`` and the loads from those in ``loads`` through TMA descriptors, the rest through pointers.

    For GEMM epilogues that store whole output tiles (the tile goes out from shared
    memory asynchronously instead of from registers) and for operands read in whole,
    unmasked tiles. A config that already chooses an ``indexing`` keeps it, except
    that the loads from the arguments in ``pointer_loads`` go through pointers: for
    small loads issued long before their use (a TMA load waits for its data where
    it is issued, a pointer load where the value is first used).

    Which slot of ``indexing`` is which load or store depends on the kernel's
    specialization (its constexpr arguments, its size-one dimensions), hence
    ``args``, and follows the generated code (``indexing_slots``); a kernel whose
    structure that walk does not know keeps ``config``. The caller checks that the
    GPU has TMA; ``launch`` runs calls with a tensor TMA cannot address through
    pointers (``_tma_addressable_config``).
    """
    chosen = config.config.get("indexing")
    if (chosen is None and not (stores or loads)) or (chosen is not None and not pointer_loads):
        return config
    specialization = tuple(
        tuple(s == 1 for s in a.shape) if isinstance(a, torch.Tensor) else a for a in args
    )
    key = (id(kernel), id(config), stores, loads, pointer_loads, specialization)
    entry = _tma_configs.get(key)
    if entry is None or entry[0] is not config:
        slots = indexing_slots(bind_kernel(kernel, args))
        if slots is None:  # a kernel structure the walk does not know: the config as it is
            entry = _tma_configs[key] = (config, config)
        else:
            if chosen is None:
                indexing = [
                    "tensor_descriptor" if op.tensor_name in (stores if op.kind == "store" else loads) else "pointer"
                    for op in slots
                ]
            else:
                indexing = [chosen] * len(slots) if isinstance(chosen, str) else list(chosen)
            indexing = [
                "pointer" if op.kind == "load" and op.tensor_name in pointer_loads else slot
                for op, slot in zip(slots, indexing)
            ]
            entry = _tma_configs[key] = (config, helion.Config(**{**config.config, "indexing": indexing}))
    return entry[1]


def _call_signature(args: tuple[object, ...]) -> tuple[object, ...]:
    # Exact shapes, strides, dtypes, devices and 16-byte alignment of the data:
    # finer than Helion's key, and everything Triton specializes a kernel on
    # (scalars derived from shapes, pointer alignment), so one signature always
    # runs the same compiled Triton kernel.
    # A list comprehension: a generator costs ~15% more per call.
    return tuple([
        (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a
        for a in args
    ])


def _launch_hooks_active() -> bool:
    """Whether a profiler or debugger hooked Triton's launches (they then go through Triton's ``run``)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class _DirectLauncher:
    """Helion's ``_launcher`` for one call signature: Triton's ``run`` once, then the compiled kernel.

    Triton's ``JITFunction.run`` binds and specializes every argument, looks the
    kernel up and builds launch metadata on each launch: a large part of a small
    kernel's host time. For one ``_call_signature`` it always picks the same
    compiled kernel, so later launches call that kernel's launcher directly,
    with the same arguments and grid. Anything unusual (Triton's CPU interpreter,
    another current device, launch hooks) takes Triton's ``run``.
    """

    __slots__ = ("kernels", "device")

    def __init__(self) -> None:
        self.kernels: dict[object, object] = {}
        self.device: int | None = None

    def __call__(self, triton_kernel: object, grid: tuple[int, ...], *args: object, **options: object) -> object:
        kernel = self.kernels.get(triton_kernel)
        if kernel is None or _launch_hooks_active() or driver.active.get_current_device() != self.device:
            return self._launch_through_triton(triton_kernel, grid, args, options)
        n = len(grid)
        kernel.run(  # type: ignore[attr-defined]
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
            driver.active.get_current_stream(self.device),
            kernel.function, kernel.packed_metadata, None, None, None, *args,  # type: ignore[attr-defined]
        )
        return kernel

    def _launch_through_triton(
        self, triton_kernel: object, grid: tuple[int, ...], args: tuple[object, ...], options: dict[str, object]
    ) -> object:
        kernel = default_launcher(triton_kernel, grid, *args, **options)  # type: ignore[arg-type]
        # The interpreter returns no compiled kernel: nothing to launch directly.
        if getattr(kernel, "function", None) is not None and not _launch_hooks_active():
            self.kernels[triton_kernel] = kernel
            self.device = driver.active.get_current_device()
        return kernel


# (id(kernel), id(config), call signature) -> (kernel, config, compiled function, its launcher).
_compiled: dict[
    tuple[object, ...], tuple[helion.Kernel, helion.Config, Callable[..., object], _DirectLauncher]
] = {}
_MAX_FAST_PATH_ENTRIES = 4096
# (id(bound kernel), id(config)) -> (bound kernel, config, Helion's compiled function for it, or for
# the config with fewer stages that fits): a new call signature of a known specialization (launches
# whose token counts change every step) skips Helion's config normalization, about 120 us a call.
_compiled_functions: dict[tuple[int, int], tuple[BoundKernel, helion.Config, Callable[..., object]]] = {}
_thread_state = threading.local()


def launch(kernel: helion.Kernel, args: Sequence[object], config: helion.Config) -> object:
    """Run ``kernel(*args)`` compiled with ``config`` (compilations are cached per config).

    Launchers call this on every training step, so repeated calls take a fast
    path: one dictionary lookup from the exact call signature to the compiled
    function (the kernel and config are kept alive by the entry, so their ids
    cannot be reused by other objects), whose Triton kernel is then launched
    directly (``_DirectLauncher``).
    """
    args = tuple(args)
    if not getattr(_thread_state, "allocator_set", False):
        # Device-side tensor descriptors need Triton's scratch allocator, which lives
        # in a context variable: Helion sets it only for host-side descriptors, and
        # autograd's backward threads start without it.
        helion.runtime.set_triton_allocator()
        _thread_state.allocator_set = True
    key = (id(kernel), id(config), _call_signature(args))
    entry = _compiled.get(key)
    if entry is None:
        if len(_compiled) >= _MAX_FAST_PATH_ENTRIES:  # many distinct shapes: start over
            _compiled.clear()
        run_config = config
        if str(config.config.get("pid_type", "flat")).startswith("persistent") and any(
            isinstance(a, torch.Tensor) and on_cpu(a) for a in args
        ):
            # Triton's interpreter cannot run persistent programs: same tiles, one program each
            # (without the options only persistent programs take).
            persistent_only = ("num_sm_multiplier", "maxnreg")
            flat = {key: value for key, value in config.config.items() if key not in persistent_only}
            run_config = helion.Config(**{**flat, "pid_type": "flat"})
        return _first_call(key, kernel, config, run_config, args)
    return entry[2](*args, _launcher=entry[3])


def _tma_addressable(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t``: data on a 16-byte boundary, every stride but the last a multiple of 16 bytes."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in t.stride()[:-1])


def _tma_addressable_config(config: helion.Config, args: tuple[object, ...]) -> helion.Config:
    """``config`` with pointer indexing for every load and store if TMA cannot address a tensor argument.

    A descriptor over misaligned data faults on the device (a misaligned-address
    error that poisons the CUDA context), and a launcher cannot see every view a
    caller passes (a slice of a scale vector, a tensor carved out of a flat
    buffer): such calls take pointers instead, same results. Every slot, not only
    that tensor's: such calls are rare, and this holds for any kernel, including
    those whose structure ``indexing_slots`` does not know.
    """
    indexing = config.config.get("indexing")
    if indexing is None or "tensor_descriptor" not in indexing:
        return config
    if all(_tma_addressable(a) for a in args if isinstance(a, torch.Tensor)):
        return config
    return config_with(config, indexing="pointer")


def _first_call(
    key: tuple[object, ...], kernel: helion.Kernel, config: helion.Config, run_config: helion.Config, args: tuple
) -> object:
    """Compile, run and remember ``kernel`` for a new call signature.

    A config is tuned for one output dtype and may need more shared memory for
    another (an fp32 epilogue tile is twice a bf16 one): when Triton reports that
    the compiled kernel does not fit, it is recompiled with one pipeline stage
    less, down to one. This happens before any launch, so nothing has run.
    """
    bound = bind_kernel(kernel, args)
    run_config = _tma_addressable_config(run_config, args)
    function_key = (id(bound), id(run_config))
    known = _compiled_functions.get(function_key)
    if known is not None and known[0] is bound and known[1] is run_config:
        # Another call signature of the same specialization (a new token count, say): Helion's
        # compiled function is reused as it is, without normalizing the config again.
        launcher = _DirectLauncher()
        result = known[2](*args, _launcher=launcher)
        _compiled[key] = (kernel, config, known[2], launcher)
        return result
    requested = run_config
    while True:
        compiled = bound.compile_config(run_config)
        launcher = _DirectLauncher()
        try:
            result = compiled(*args, _launcher=launcher)
        except OutOfResources:
            stages = int(run_config.config.get("num_stages", 1))
            if stages <= 1:
                raise
            run_config = helion.Config(**{**run_config.config, "num_stages": stages - 1})
            continue
        if len(_compiled_functions) >= _MAX_FAST_PATH_ENTRIES:
            _compiled_functions.clear()
        _compiled_functions[function_key] = (bound, requested, compiled)
        _compiled[key] = (kernel, config, compiled, launcher)
        return result
