"""``kernels_helion.interpreter_speedups``: the reductions give Helion's helpers' values bit for bit; the
device-call wrapper patches what is unpatched and skips what is; tuple type names are the eager ones;
the interpreter builds without the integer overflow checks that its options drop."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

from kernels_helion import interpreter_speedups
from tests.support import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="installed only under Triton's interpreter")

ROWS, COLS = 8, 16


@triton.jit
def _reduce_kernel(x_ptr, out_ptr, FN: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    x = tl.load(x_ptr + rows[:, None] * COLS + cols[None, :])
    out = FN(x, DIM)
    if DIM == 0:
        tl.store(out_ptr + cols, out)
    else:
        tl.store(out_ptr + rows, out)


def _reduce(fn: object, x: torch.Tensor, dim: int) -> torch.Tensor:
    out_dtype = x.dtype if x.element_size() >= 4 else (torch.float32 if x.is_floating_point() else torch.int32)
    out = torch.full((x.size(1 - dim),), 7, dtype=out_dtype)  # poisoned
    _reduce_kernel[(1,)](x, out, fn, dim, ROWS, COLS)
    return out


def _data(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        x = torch.randn(ROWS, COLS).to(dtype)
        x[1, 3] = float("nan")  # a NaN in row 1 and column 3
        x[2, 5] = float("inf")
        x[3, 6] = -float("inf")
        x[4, :] = -0.0
        x[:, 9] = 0.0
        x[5, 9] = -0.0
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (ROWS, COLS), dtype=torch.int64).to(dtype)


def test_installed_under_the_interpreter():
    from helion.runtime.triton import helpers

    assert helpers.max_propagate_nan is interpreter_speedups.max_propagate_nan
    assert helpers.min_propagate_nan is interpreter_speedups.min_propagate_nan
    from triton.runtime import interpreter

    assert interpreter._patch_lang is interpreter_speedups.patch_lang_once
    lazy_names = {"tuple_type.__init__"} if "tuple_type.__init__" in interpreter_speedups.REPLACED else set()
    assert set(interpreter_speedups.REPLACED) == {
        "max_propagate_nan", "min_propagate_nan", "_patch_lang", "InterpreterBuilder.__init__", *lazy_names
    }
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    assert not interpreter.InterpreterBuilder().options.sanitize_overflow
    assert isinstance(triton.language.core.tuple_type.__dict__.get("name"), (property, functools.cached_property))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int16, torch.int8])
@pytest.mark.parametrize("name", ["max_propagate_nan", "min_propagate_nan"])
@pytest.mark.parametrize("dim", [0, 1])
def test_same_bits_as_helions_helpers(name, dtype, dim):
    x = _data(dtype)
    ours = _reduce(getattr(interpreter_speedups, name), x, dim)
    helions = _reduce(interpreter_speedups.REPLACED[name], x, dim)
    assert ours.dtype == helions.dtype
    assert torch.equal(ours.view(torch.uint8), helions.view(torch.uint8)), (ours, helions)
    expected = (torch.amax if name == "max_propagate_nan" else torch.amin)(x.to(ours.dtype), dim=dim)
    torch.testing.assert_close(ours, expected, equal_nan=True, rtol=0, atol=0)
    if dtype.is_floating_point:
        assert ours.isnan().any()  # the NaN propagated


def _count_patches(monkeypatch) -> list[str]:
    """Names of the functions the interpreter's own ``_patch_lang`` runs for from now on."""
    seen: list[str] = []
    original = interpreter_speedups.REPLACED["_patch_lang"]

    def counting(fn):
        seen.append(fn.__name__)
        return original(fn)

    monkeypatch.setitem(interpreter_speedups.REPLACED, "_patch_lang", counting)
    return seen


@triton.jit
def _helper(x):
    return tl.maximum(x, 0.0) + 1.0


@triton.jit
def _calls_helpers_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _helper(_helper(x)) + tl.sum(x, 0))


def test_device_calls_skip_repatching_and_launches_patch_and_restore(monkeypatch):
    seen = _count_patches(monkeypatch)
    x = torch.randn(16)
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        _calls_helpers_kernel[(1,)](x, out, 16)
        torch.testing.assert_close(out, torch.clamp(torch.clamp(x, min=0) + 1, min=0) + 1 + x.sum())
    # Each launch patches (its walk finds the builtins its last restore put back); the helper calls,
    # made with the language patched, do not walk it again.
    assert seen == ["_calls_helpers_kernel", "_calls_helpers_kernel"]
    assert tl.core.is_builtin(tl.load)  # restored after the launch


def test_unpatched_language_is_patched(monkeypatch):
    seen = _count_patches(monkeypatch)
    assert tl.core.is_builtin(tl.load)  # outside a launch: unpatched
    scope = interpreter_speedups.patch_lang_once(_helper.fn)
    try:
        assert seen == ["_helper"] and not tl.core.is_builtin(tl.load)
        interpreter_speedups.patch_lang_once(_helper.fn)  # patched now: skipped
        assert seen == ["_helper"]
    finally:
        scope.restore()
    assert tl.core.is_builtin(tl.load)


def test_function_that_sees_no_language_gets_the_interpreters_error():
    namespace: dict = {}
    exec("def no_language():\n    pass", namespace)
    with pytest.raises(AssertionError, match="triton.language must be visible"):
        interpreter_speedups.patch_lang_once(namespace["no_language"])


def test_tuple_type_names_are_the_eager_ones():
    tuple_type = tl.core.tuple_type
    original = interpreter_speedups.REPLACED.get("tuple_type.__init__")
    if original is None:  # Triton >= 3.8: the name is built when read upstream
        assert "name" in tuple_type.__dict__
        return
    types = [tl.int32, tl.constexpr_type(4), tl.block_type(tl.float32, [2, 8])]
    for fields in (None, ["a", "b", "c"]):
        lazy = tuple_type(types, fields)
        assert "_lazy_name" not in lazy.__dict__  # nothing formatted until read
        eager = object.__new__(tuple_type)
        original(eager, types, fields)
        assert lazy.name == str(lazy) == eager.__dict__["_lazy_name"] and lazy.fields == eager.fields
    assert tl.tuple([1, 2]).type.name == "[:constexpr_type[1],:constexpr_type[2]]"
