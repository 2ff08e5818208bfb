"""Four changes that make Triton's interpreter (the CPU runs) faster and give the same results.

``install()`` applies them when ``TRITON_INTERPRET=1``; compiled kernels (GPUs) are untouched.

1. **NaN-propagating max/min reductions.** Helion lowers ``torch.amax``/``torch.amin`` in a
   kernel to ``helion.runtime.triton.helpers.max_propagate_nan``/``min_propagate_nan``: a
   ``tl.reduce`` with a custom combine function. The interpreter runs a reduce with a custom
   combine one element at a time in Python, and one with ``tl.max``/``tl.min``'s combine as a
   single numpy reduction (``nanmax``/``nanmin``). Every quantizer reduces amaxes this way: on
   the CPU they took most of a training step (80% of the demo's FP8 step, in the per-group
   activation amax pass). The replacements below give the same values through ``tl.max``/
   ``tl.min`` plus a NaN test of the reduced axis: the operand is promoted to 32 bits as
   Helion's helpers do, and a NaN in a reduced slice makes that slice's result NaN.
2. **Device-function calls.** On every call of a ``@triton.jit`` function from inside a kernel
   (Helion's and torch's helpers: ``triton_helpers.maximum``, ``max_propagate_nan``, ...) the
   interpreter re-runs ``_patch_lang``, which walks every member of ``triton.language`` with
   ``inspect.getmembers`` to replace its builtins by interpreted ones. Once the kernel's launch
   has patched a module the walk finds no builtin left to replace, and what it sets besides
   (``range``, ``reduce``, tensor methods) is equivalent to what the launch set, yet it took about a quarter
   of an interpreted step. The wrapper skips it when every language module the function sees
   is already patched (its ``load`` is no longer a builtin) and runs it otherwise, so the first
   patch of each module and each launch's own patch and restore happen as before.
3. **Tuple type names built when read** (Triton 3.6 only). The interpreter makes a
   ``tl.tuple`` of constexprs for the shape of every tensor it creates, and Triton 3.6's
   ``tuple_type.__init__`` formats that tuple type's name each time, though almost none is
   read: about a tenth of an interpreted layer test. Triton 3.8 builds the name when read
   (a ``cached_property``); ``make_tuple_type_names_lazy`` does the same on 3.6.

4. **No integer overflow checks whose result is dropped.** The interpreter builds with
   ``sanitize_overflow=True``: each 8-32-bit integer ``+``/``-``/``*`` is computed again in
   int64 and compared with its type's range, for a ``device_assert`` that Triton emits only with
   ``debug=True``, which the interpreter's options leave off. That dropped work was about a third
   of an interpreted layer test; ``skip_integer_overflow_checks`` turns it off (the values and
   the checks that run are the same).

``tests/test_interpreter_speedups.py`` holds the reductions to Helion's own helpers, the
wrapper to patching what is unpatched, the tuple names to the eager ones.
"""

from __future__ import annotations

import inspect
import os

import triton
import triton.language as tl


@triton.jit
def _promote_to_32_bits(x: tl.tensor) -> tl.tensor:
    # As Helion's helpers (and tl.max/tl.min) do: the reduction runs on >= 32-bit values.
    if tl.constexpr(x.dtype.primitive_bitwidth) < tl.constexpr(32):
        if tl.constexpr(x.dtype.is_floating()):
            x = x.to(tl.float32)
        else:
            x = x.to(tl.int32)
    return x


@triton.jit
def _nan_where_any(x: tl.tensor, reduced: tl.tensor, dim: tl.constexpr) -> tl.tensor:
    """``reduced`` with NaN where the slice of ``x`` it came from holds a NaN."""
    if tl.constexpr(x.dtype.is_floating()):
        has_nan = tl.max((x != x).to(tl.int32), dim)
        reduced = tl.where(has_nan > 0, float("nan"), reduced)
    return reduced


@triton.jit
def max_propagate_nan(x: tl.tensor, dim: tl.constexpr) -> tl.tensor:
    """``torch.amax`` along ``dim``: NaN if the slice holds one."""
    x = _promote_to_32_bits(x)
    return _nan_where_any(x, tl.max(x, dim), dim)


@triton.jit
def min_propagate_nan(x: tl.tensor, dim: tl.constexpr) -> tl.tensor:
    """``torch.amin`` along ``dim``: NaN if the slice holds one."""
    x = _promote_to_32_bits(x)
    return _nan_where_any(x, tl.min(x, dim), dim)


# What ``install()`` replaced, by name (the tests compare against Helion's helpers).
REPLACED: dict[str, object] = {}


_languages_seen: dict[object, tuple[object, ...]] = {}


def _languages(fn: object) -> tuple[object, ...]:
    """The ``triton.language`` modules ``fn`` sees, as the interpreter's ``_patch_lang`` finds them (cached per function)."""
    langs = _languages_seen.get(fn)
    if langs is None:
        langs = _languages_seen[fn] = tuple(v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return langs


def patch_lang_once(fn: object) -> object:
    """The interpreter's ``_patch_lang(fn)``, skipped when each language module ``fn`` sees is already patched."""
    from triton.runtime import interpreter

    langs = _languages(fn)  # none visible: the original raises its own error
    if langs and all(not tl.core.is_builtin(lang.load) for lang in langs):
        return interpreter._LangPatchScope()  # nothing to patch, so nothing to restore
    return REPLACED["_patch_lang"](fn)


def _tuple_type_init(self, types, fields=None) -> None:
    """Triton 3.6's ``tuple_type.__init__`` without its eager ``name`` (``_tuple_type_name`` builds it when read)."""
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self) -> str:
    """The name Triton 3.6's ``tuple_type.__init__`` builds, built when read and kept."""
    name = self.__dict__.get("_lazy_name")
    if name is None:
        name = self.__dict__["_lazy_name"] = "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"
    return name


def _set_tuple_type_name(self, name: str) -> None:
    self.__dict__["_lazy_name"] = name


def make_tuple_type_names_lazy() -> bool:
    """Build ``tl.tuple_type.name`` when it is read, as newer Triton does; whether it patched.

    Triton 3.6 formats the name of every tuple type as it is made, and the interpreter makes one
    for the shape of every tensor it creates (most of them never named). Triton 3.8 made the
    name a ``cached_property``; there, and wherever ``__init__`` is not 3.6's, nothing changes.
    """
    tuple_type = tl.core.tuple_type
    if "name" in tuple_type.__dict__ or "self.name = " not in inspect.getsource(tuple_type.__init__):
        return False
    REPLACED.setdefault("tuple_type.__init__", tuple_type.__init__)
    tuple_type.__init__ = _tuple_type_init
    tuple_type.name = property(_tuple_type_name, _set_tuple_type_name)
    return True


def skip_integer_overflow_checks() -> None:
    """Interpreted integer ``+``/``-``/``*`` without the overflow checks whose assertion is off (see the module docstring)."""
    from dataclasses import replace

    from triton.runtime import interpreter

    builder_init = REPLACED.setdefault("InterpreterBuilder.__init__", interpreter.InterpreterBuilder.__init__)

    def without_dropped_checks(builder: object) -> None:
        if not builder.options.debug:  # with debug=True the assertions run: the checks stay
            builder.options = replace(builder.options, sanitize_overflow=False)

    def init(self, *args, **kwargs) -> None:
        builder_init(self, *args, **kwargs)
        without_dropped_checks(self)

    interpreter.InterpreterBuilder.__init__ = init
    singleton = getattr(interpreter, "interpreter_builder", None)
    if singleton is not None:
        without_dropped_checks(singleton)


def install() -> bool:
    """Under Triton's interpreter, apply the changes (see the module docstring); whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from helion.runtime.triton import helpers
    from triton.runtime import interpreter

    for name in ("max_propagate_nan", "min_propagate_nan"):
        REPLACED.setdefault(name, getattr(helpers, name))
    helpers.max_propagate_nan = max_propagate_nan
    helpers.min_propagate_nan = min_propagate_nan
    if hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope"):
        REPLACED.setdefault("_patch_lang", interpreter._patch_lang)
        interpreter._patch_lang = patch_lang_once
    make_tuple_type_names_lazy()
    skip_integer_overflow_checks()
    return True
