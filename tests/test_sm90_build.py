"""benchmarks.sm90_build: a kernel compiled for sm90 on any machine, with its resources.

The builds run in a child process: the CPU test session runs Triton's interpreter,
whose helper functions cannot be compiled for a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_BUILD = """
import json, sys
import kernels_helion  # before helion: kernels_helion.helion_setup
import helion, torch
from benchmarks.sm90_build import sm90_build
from kernels_helion.quantize_mx import quantize_mx_cols_kernel
# quantize_mx_cols's input: (1, M, K), blocks of 32 tokens along M.
src = torch.randn(1, 4096, 256, dtype=torch.bfloat16)
scales = torch.empty(1, 4096 // 32, 256, dtype=torch.uint8).transpose(1, 2)  # block-major, as quantize_mx_cols's
block_t, block_f, warps = json.loads(sys.argv[1])
config = helion.Config(block_sizes=[block_f], num_warps=warps)
build = sm90_build(quantize_mx_cols_kernel, (src, scales, block_t, 32, True), config)
print(json.dumps({"registers": build.registers, "spill_bytes": build.spill_bytes, "memory_ops": build.memory_ops,
                  "convert_layout": "ttg.convert_layout" in build.ttgir, "sm_90": ".target sm_90" in build.ptx}))
"""


def _build(block_t: int, block_f: int, warps: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # importing kernels_helion would default it to 1
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _BUILD, json.dumps([block_t, block_f, warps])],
        capture_output=True, text=True, env=env, cwd=root, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_specialized_like_the_gpu_and_fits_in_registers():
    build = _build(block_t=64, block_f=128, warps=2)  # the tuned tile
    assert 0 < build["registers"] <= 255 and build["spill_bytes"] == 0
    # The unit stride is specialized as on the GPU: the tile moves in 16-byte loads and stores
    # (unspecialized, each bf16 value would be its own 2-byte load: 128 a thread here).
    ops = build["memory_ops"]
    assert ops.get("ld.global.v4.b32", 0) >= 8 and ops.get("st.global.v4.b32", 0) >= 4
    assert ops.get("ld.global.b16", 0) <= 1
    # The block-major scales go out 4 bytes a store; stored (K, M // 32), a program's 2 bytes
    # on each feature row went out a byte a store.
    assert ops.get("st.global.b32", 0) >= 1 and ops.get("st.global.b8", 0) == 0
    assert build["convert_layout"] and build["sm_90"]


def test_reports_spills_of_an_oversized_tile():
    # 128 tokens x 256 features on one warp: 1024 values a thread do not fit in registers.
    build = _build(block_t=128, block_f=256, warps=1)
    assert build["registers"] > 0 and build["spill_bytes"] > 1024


def test_refuses_the_interpreter(monkeypatch):
    from benchmarks.sm90_build import sm90_build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sm90_build(None, (), None)
