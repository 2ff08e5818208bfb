"""Compile a Helion kernel for Hopper (sm90) on a machine without a GPU, and report its resources.

Device time is scarce; a tile that needs 255 registers, spills, or moves memory one
byte per instruction can be seen before any run. ``sm90_build(kernel, args, config)``
generates the kernel's Triton code for ``args`` (CPU tensors are fine) and compiles
it with the ``ptxas`` bundled in Triton's wheel, for sm90:

    >>> config = helion.Config(block_sizes=[128], num_warps=2)
    >>> build = sm90_build(quantize_mx_cols_kernel, (src, scales, 64, 32, True), config)
    >>> build.registers, build.spill_bytes, build.memory_ops["st.global.v4.b32"]

Arguments are specialized as Triton's JIT specializes them on the GPU: integers equal
to 1 become constants, integers divisible by 16 and tensor pointers are marked
16-divisible (so a unit stride gives vectorized accesses, as it does on the device).
Configs with TMA (``indexing="tensor_descriptor"``) or persistent program ids are not
supported: Helion emits those only for a GPU. Run it in a process started with
``TRITON_INTERPRET=0`` (without it, importing ``kernels_helion`` on a machine without
a GPU selects Triton's interpreter, whose helper functions cannot be compiled):

    TRITON_INTERPRET=0 python my_script.py
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile

import kernels_helion  # noqa: F401  (before helion: kernels_helion.helion_setup)
import helion
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
}
_NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_MEMORY_OP = re.compile(r"\b((?:ld|st)\.(?:global|shared)[a-zA-Z0-9_.:]*|ldmatrix[a-z0-9.:]*|stmatrix[a-z0-9.:]*)")
# Cache-policy qualifiers (``ld.global.L1::evict_last.L2::cache_hint.v4.b32``): dropped, so that
# accesses are counted by kind and width whatever eviction hint a load carries.
_CACHE_POLICY = re.compile(r"\.L[12]::[a-z_0-9]+")


@dataclasses.dataclass(frozen=True)
class Sm90Build:
    """What ``ptxas`` made of one kernel for sm90."""

    registers: int
    spill_bytes: int  # per-thread stack (local memory)
    shared_bytes: int  # dynamic shared memory Triton asks for
    memory_ops: dict[str, int]  # PTX load/store instructions by kind and width, e.g. {"st.global.v4.b32": 8}
    ttgir: str
    ptx: str
    sass: str  # nvdisasm's listing of the cubin

    @property
    def loops(self) -> list[dict[str, int]]:
        """The SASS instructions of each loop body by opcode (``{"FMUL": 384, ...}``), in code order.

        A loop is the code from a label to a branch back to it (nested loops are counted in
        their own entry and in the one around them). A tile loop's count divided by the
        elements a thread handles per iteration is its instructions per element: what an
        instruction-bound kernel's time follows (``docs/experiments.md``, "Quantizers").
        """
        return sass_loops(self.sass)


_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_loops(sass: str) -> list[dict[str, int]]:
    """Opcode counts of each loop body in an nvdisasm listing (see ``Sm90Build.loops``)."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    loops = []
    for i, line in enumerate(lines):
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = i
        branch = _SASS_BRANCH.search(line)
        if branch and labels.get(branch.group(1), i) < i:
            body = (_SASS_OPCODE.match(text) for text in lines[labels[branch.group(1)] : i + 1])
            ops = collections.Counter(op.group(1) for op in body if op)
            if sum(ops.values()) > 1:  # not the branch to itself that ends every kernel
                loops.append(dict(ops))
    return loops


def _captured_launch(
    kernel: helion.Kernel, args: tuple[object, ...], config: helion.Config
) -> tuple[JITFunction, tuple, dict]:
    """The Triton function, its arguments and launch options that Helion's host code would launch."""
    captured: dict[str, object] = {}

    def capture(fn: object, grid: object, *launch_args: object, **options: object) -> None:
        captured.update(fn=fn, args=launch_args, options=options)

    kernel.bind(args).compile_config(config)(*args, _launcher=capture)
    fn = captured["fn"]
    assert isinstance(fn, JITFunction)
    return fn, captured["args"], captured["options"]


def sm90_build(kernel: helion.Kernel, args: tuple[object, ...], config: helion.Config) -> Sm90Build:
    """Compile ``kernel`` for ``args`` with ``config`` for sm90 (no GPU needed) and report its resources."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("sm90_build compiles for the GPU: start the process with TRITON_INTERPRET=0")
    fn, launch_args, options = _captured_launch(kernel, args, config)
    signature: dict[str, str] = {}
    constants: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for i, (param, name) in enumerate(zip(fn.params, fn.arg_names)):
        value = launch_args[i] if i < len(launch_args) else param.default
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name] = "constexpr"
            constants[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"argument {name!r} of type {type(value).__name__} is not supported (TMA descriptor?)")
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 1)},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [os.path.join(_NVIDIA_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [os.path.join(_NVIDIA_BIN, "nvdisasm"), "-c", "-hex", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{usage}")
    ptx = compiled.asm["ptx"]
    return Sm90Build(
        registers=int(found.group(1)),
        spill_bytes=int(found.group(2)),
        shared_bytes=int(compiled.metadata.shared),
        memory_ops=dict(collections.Counter(_CACHE_POLICY.sub("", op) for op in _MEMORY_OP.findall(ptx))),
        ttgir=compiled.asm["ttgir"],
        ptx=ptx,
        sass=sass,
    )
