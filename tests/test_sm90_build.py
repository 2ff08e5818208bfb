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
                  "convert_layout": "ttg.convert_layout" in build.ttgir, "sm_90": ".target sm_90" in build.ptx,
                  "loops": build.loops, "sass_ops": build.sass.count(" ;")}))
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
    assert build["loops"] == [] and build["sass_ops"] > 100  # one tile a program: no loop in its SASS


_AMAX_LOOP = """
import json
import kernels_helion  # before helion: kernels_helion.helion_setup
import helion, torch
from benchmarks.sm90_build import sm90_build
from kernels_helion.group_offsets import group_lanes
from kernels_helion.quantize_rowwise_two_pass import quantize_rowwise_rows_and_cols_grouped_amax_kernel
from kernels_helion.token_groups import padded_token_count
from kernels_helion.tuning import routed_pairs
# The gathered amax pass as w2's backward runs it (both folds, rows before their weights), shipped tile.
tokens, top_k, groups, k = 256, 8, 32, 7168
pair_tokens, offs = routed_pairs(tokens, top_k, groups, torch.device("cpu"))
m = tokens * top_k
args = (torch.randn(tokens, k).bfloat16(), offs, torch.rand(groups, k), torch.rand(m), pair_tokens, torch.rand(m),
        padded_token_count(m, groups, 64), group_lanes(groups), 64, True, True, True, True, False, False, False)
config = helion.Config(block_sizes=[64, 512, 64], num_warps=1, num_stages=1)
print(json.dumps(sm90_build(quantize_rowwise_rows_and_cols_grouped_amax_kernel, args, config).loops))
"""


def test_loops_of_the_gathered_amax_pass():
    """The amax pass's column loop in SASS: a 64 x 64 tile on one warp is 128 elements a thread, each
    multiplied three times (its pair's weight, its group's row multiplier, its token multiplier)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _AMAX_LOOP], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (loop,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert loop["FMUL"] == 3 * 128 and loop["F2F"] == 128  # the weighted value rounded to bf16 once
    assert 8 * 128 < sum(loop.values()) < 16 * 128


def test_sass_loops_counts_each_loop_body():
    from benchmarks.sm90_build import sass_loops

    listing = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   FMUL R2, R2, R3 ;",
        "        /*0020*/              @P0 LOP3.LUT R2, R2, 0x7fffffff, RZ, 0xc0, !PT ;",
        "        /*0030*/              @!P1 BRA `(.L_x_0) ;",
        "        /*0040*/                   EXIT ;",
        ".L_x_1:",
        "        /*0050*/                   BRA `(.L_x_1);",
    ])
    assert sass_loops(listing) == [{"FMUL": 1, "LOP3": 1, "BRA": 1}]


def test_reports_spills_of_an_oversized_tile():
    # 128 tokens x 256 features on one warp: 1024 values a thread do not fit in registers.
    build = _build(block_t=128, block_f=256, warps=1)
    assert build["registers"] > 0 and build["spill_bytes"] > 1024


def test_refuses_the_interpreter(monkeypatch):
    from benchmarks.sm90_build import sm90_build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sm90_build(None, (), None)
