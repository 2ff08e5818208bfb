"""Helpers shared by the tests: device, references' building blocks, comparisons, offsets."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# The CPU (gloo) variants of the distributed tests run where there is no GPU (Helion's kernels take
# CPU tensors only under Triton's interpreter); a GPU machine runs their NCCL variants.
gloo_cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU (gloo) variant; the GPU runs the NCCL variant")

# Quantities that are NaN-poisoned before a kernel writes them.
POISON_FLOAT = float("nan")


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` filled with NaN (floats) or 0xFF bits (fp8/ints)."""
    if t.dtype.is_floating_point and t.element_size() > 1:
        return torch.full_like(t, POISON_FLOAT)
    return torch.full(t.shape, 0xFF, dtype=torch.uint8, device=t.device).view(t.dtype)


def poison_torch_empty(monkeypatch: object) -> None:
    """Make ``torch.empty`` return poison (NaN / -1 / 0xFF bits): launchers allocate outputs with it,
    so an element no program writes shows in the result."""
    real_empty = torch.empty

    def poisoned_empty(*shape: object, dtype: torch.dtype | None = None, device: object = None, **kwargs: object):
        t = real_empty(*shape, dtype=dtype, device=device, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1 if t.is_signed() else 0xFF)

    monkeypatch.setattr(torch, "empty", poisoned_empty)  # type: ignore[attr-defined]


def misaligned_copy(t: torch.Tensor, offset: int = 4) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts ``offset`` bytes past a 16-byte boundary (TMA cannot address it)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + 32, dtype=torch.uint8, device=t.device)
    start = (16 - raw.data_ptr() % 16) % 16 + offset
    copy = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``actual`` against ``reference``."""
    ref = reference.detach().double()
    noise = (actual.detach().double() - ref).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """FP8 tensors equal bit for bit (any NaN matches any NaN).

    Our kernels round in fp32 before an exact cast, so they agree with PyTorch's
    cast bitwise on GPUs and on Triton's CPU interpreter alike.
    """
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.float(), expected.float()
    both_nan = a.isnan() & e.isnan()
    same = (actual.view(torch.uint8) == expected.view(torch.uint8)) | both_nan
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(
            f"{int((~same).sum())} of {same.numel()} fp8 elements differ; first at {idx}: "
            f"actual {[a[tuple(i)].item() for i in idx]} expected {[e[tuple(i)].item() for i in idx]}"
        )


def offsets_from_sizes(sizes: list[int], device: torch.device = DEVICE) -> torch.Tensor:
    """int32 cumulative group ends, as ``torch._grouped_mm`` takes them."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def grouped_linear_problem(
    sizes: list[int], m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x (m, k), w (G, n, k), offs, grad_out (m, n))``, random, for a grouped linear with groups ``sizes``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    grad_out = torch.randn(m, n, device=device, generator=gen).to(dtype)
    return x, w, offsets_from_sizes(sizes, device), grad_out


def fwd_bwd(
    fn, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor, needs: tuple[bool, bool] = (True, True)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``fn(x, w, offs)`` and its backward from ``grad_out``: ``(out, dx, dw)`` (``needs``: which inputs want grads)."""
    x, w = x.detach().requires_grad_(needs[0]), w.detach().requires_grad_(needs[1])
    out = fn(x, w, offs)
    out.backward(grad_out)
    return out.detach(), x.grad, w.grad


def group_sizes(total: int, groups: int, kind: str = "uniform", align: int = 1, seed: int = 0) -> list[int]:
    """Token counts per group summing to at most ``total``.

    kind: ``uniform`` (equal split), ``skewed`` (Dirichlet(1) routing), ``empty``
    (some groups empty), ``one`` (a one-token group), ``unaligned`` (sizes that
    are not multiples of 16). With ``align > 1`` every size is a multiple of it
    (the remainder is left as tokens past the last group end).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        sizes = [total // groups] * groups
    elif kind == "skewed":
        weights = torch.distributions.Dirichlet(torch.ones(groups)).sample()
        sizes = [int(w) for w in (weights * total).floor()]
    elif kind == "empty":
        sizes = [0 if g % 3 == 1 else total // groups for g in range(groups)]
    elif kind == "one":
        sizes = [1] + [(total - 1) // max(groups - 1, 1)] * (groups - 1)
    elif kind == "unaligned":
        base = torch.randint(1, max(2, 2 * total // groups), (groups,), generator=gen)
        sizes = [int(s) | 1 for s in base]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    sizes = [s // align * align for s in sizes]
    while sum(sizes) > total:
        g = max(range(groups), key=lambda i: sizes[i])
        sizes[g] -= min(sizes[g], max(align, sum(sizes) - total) // align * align or align)
    return sizes


def custom_ops_defined_in(module: object) -> set[str]:
    """Names of the ``fp8moe`` custom ops that ``module`` defines, without namespace."""
    from ops.op_registry import Fp8moeOp

    return {op.name for op in vars(module).values() if isinstance(op, Fp8moeOp)}


def _is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _bits(t: object) -> object:
    return t.view(torch.uint8).clone() if _is_fp8(t) else t.clone() if isinstance(t, torch.Tensor) else t


def opcheck_fp8(op: object, args: tuple, mutable: Iterable[str] = ()) -> None:
    """``torch.library.opcheck`` of a custom op that may take FP8 tensors.

    test_autograd_registration is moot: the ops have no autograd (``ops.autograd*``
    supplies it). test_schema compares inputs with torch.allclose, which has no fp8
    kernel: for ops with fp8 inputs, its two rules (no mutation of arguments other
    than ``mutable``, no output aliasing an input) are checked here instead.
    """
    fp8_inputs = any(map(_is_fp8, args))
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") + (() if fp8_inputs else ("test_schema",))
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert all(v == "SUCCESS" for v in result.values()), (op, result)
    if fp8_inputs:
        before = [_bits(a) for a in args]
        outs = op(*args)
        for arg, old, schema_arg in zip(args, before, op.default._schema.arguments):
            if isinstance(arg, torch.Tensor) and schema_arg.name not in mutable:
                assert torch.equal(_bits(arg), old), (op, schema_arg.name)
        in_storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for out in outs if isinstance(outs, tuple) else (outs,) if outs is not None else ():
            assert out.untyped_storage().data_ptr() not in in_storages, op


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_auto_choices_off_hopper(setattr_fn=setattr) -> None:
    """Make the recipe's ``"auto"`` choices see no Hopper GPU (the tests' rule): ``wgrad_precision`` then
    takes the FP8 wgrad and ``down_dgrad_token_rows`` the folded dgrad, as on the CPU."""
    from ops import wgrad_precision

    setattr_fn(wgrad_precision, "on_hopper", lambda x: False)


def _distributed_entry(
    rank: int, fn, world_size: int, port: int, backend: str, timeout_s: float, error_dir: str, args: tuple
) -> None:
    import faulthandler

    faulthandler.enable()  # a rank that crashes or hangs in native code prints its Python stack
    pin_auto_choices_off_hopper()  # the ranks follow the tests' rule (tests/conftest.py)
    try:
        _distributed_run(rank, fn, world_size, port, backend, timeout_s, args)
    except BaseException:
        # Written before this process exits, so before its peers see the connection close and fail in
        # turn: run_distributed reports the rank that failed first, not the peer the spawner saw first.
        import traceback

        with open(os.path.join(error_dir, f"rank{rank}"), "w") as f:
            f.write(f"{time.time()!r} {os.getpid()}\n{traceback.format_exc()}")
        raise


def rank_device(rank: int, backend: str) -> torch.device:
    """The device of ``rank`` in a ``run_distributed`` world: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _distributed_run(rank: int, fn, world_size: int, port: int, backend: str, timeout_s: float, args: tuple) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": rank_device(rank, backend)} if backend == "nccl" else {}),
    )
    fn(rank, world_size, *args)
    # Only after success: a rank that failed exits at once and the spawner stops the others (a failed
    # rank that destroys the group waits there until its peer's collective times out). The exit skips
    # the interpreter's teardown, where gloo's threads can abort a process whose checks all passed
    # ("terminate called without an active exception", SIGABRT) when the CPU is loaded.
    dist.destroy_process_group()
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn, world_size: int, *args: object, backend: str = "gloo", timeout_s: float = 120, join_timeout_s: float | None = None
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes, each in one process group.

    ``fn`` must be a module-level function (it is pickled); the device of a rank is
    ``rank_device(rank, backend)``. Every collective times out after ``timeout_s`` (a
    hang fails instead of blocking); with ``join_timeout_s``, ranks still running that
    long after the start are killed and the call raises ``TimeoutError``. An exception
    in any process fails the call with its traceback.
    """
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as error_dir:
        try:
            context = mp.start_processes(
                _distributed_entry,
                args=(fn, world_size, free_port(), backend, timeout_s, error_dir, args),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
            deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
            while not context.join(timeout=5):
                if deadline is not None and time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"{fn.__name__}: ranks did not finish in {join_timeout_s} s")
        except mp.ProcessRaisedException as e:
            first = _first_failure(error_dir)
            if first is None:
                raise
            rank, pid, trace = first
            raise mp.ProcessRaisedException(f"\n\n-- rank {rank} failed first:\n{trace}", rank, pid) from e


def _first_failure(error_dir: str) -> tuple[int, int, str] | None:
    """The rank whose error file has the earliest time, its pid and traceback (None when no rank wrote one)."""
    failures = []
    for name in os.listdir(error_dir):
        with open(os.path.join(error_dir, name)) as f:
            header, _, trace = f.read().partition("\n")
        try:
            stamp, pid = header.split()
            failures.append((float(stamp), int(name.removeprefix("rank")), int(pid), trace))
        except ValueError:  # a peer stopped by the spawner while writing its file
            continue
    if not failures:
        return None
    _, rank, pid, trace = min(failures)
    return rank, pid, trace


def record_kernel_calls(monkeypatch: pytest.MonkeyPatch, names: Iterable[str]) -> dict[str, list[tuple]]:
    """The positional arguments of every call of the named ``fp8moe`` kernel ops (``ops.op_registry``),
    which still run; lists to clear between the steps a test counts."""
    from ops import op_registry

    calls: dict[str, list[tuple]] = {name: [] for name in names}
    for name in calls:
        real = op_registry._functions[name]

        def recorded(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_name].append(args)
            return _real(*args, **kwargs)

        monkeypatch.setitem(op_registry._functions, name, recorded)
    return calls
