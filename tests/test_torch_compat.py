"""kernels_helion.torch_compat: helion 1.5 on torch releases that lack names it uses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels_helion import torch_compat

REPO = Path(__file__).resolve().parent.parent
TORCH_HAS_INTEL_GPU_ERROR = torch.__version__ >= (2, 12)
# torch.distributed._symmetric_memory.is_symm_mem_tensor came with torch 2.12 too.
TORCH_HAS_IS_SYMM_MEM_TENSOR = torch.__version__ >= (2, 12)


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter from the repository root; fail with its output."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_supplies_only_the_missing_names() -> None:
    from torch._inductor.runtime import triton_compat

    expected = (() if TORCH_HAS_INTEL_GPU_ERROR else ("IntelGPUError",)) + (
        () if TORCH_HAS_IS_SYMM_MEM_TENSOR else ("is_symm_mem_tensor",)
    )
    assert torch_compat.SUPPLIED == expected
    assert issubclass(triton_compat.IntelGPUError, Exception)


def test_defines_intel_gpu_error_before_helion_loads_when_torch_lacks_it() -> None:
    # torch 2.11 as helion sees it: the name removed before our package (and helion) first load.
    _run_python(
        f"""
        import sys
        import torch._inductor.runtime.triton_compat as triton_compat
        if hasattr(triton_compat, "IntelGPUError"):
            del triton_compat.IntelGPUError
        assert "helion" not in sys.modules
        import kernels_helion
        from kernels_helion import torch_compat
        import helion.autotuner.logger as logger
        expected = ("IntelGPUError",) + (() if {TORCH_HAS_IS_SYMM_MEM_TENSOR} else ("is_symm_mem_tensor",))
        assert torch_compat.SUPPLIED == expected, torch_compat.SUPPLIED
        assert logger.IntelGPUError is triton_compat.IntelGPUError
        assert issubclass(triton_compat.IntelGPUError, Exception)
        """
    )


def test_kernels_keep_their_program_layouts_in_a_process_group_when_torch_lacks_is_symm_mem_tensor() -> None:
    # torch 2.11 as helion sees it: no is_symm_mem_tensor. In a process with a process group,
    # helion then takes every kernel for a symmetric-memory one (persistent layouts only, the
    # flat configs our kernels are tuned with refused). With the supplied function our kernels
    # bind as ordinary kernels: all program layouts allowed, no distributed warnings.
    _run_python(
        """
        import io, contextlib, warnings
        import torch, torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "is_symm_mem_tensor"):
            del symm_mem.is_symm_mem_tensor
        from tests.support import free_port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.randn(4, 32, dtype=torch.bfloat16, device=device)
        # quantize_rowwise_rows_args(x), written out: importing kernels_helion would supply the function.
        args = (x, x, x, 448.0, False, False, 32, 16, 1, False, x, False)
        import torch._inductor.runtime.triton_compat as triton_compat
        if hasattr(triton_compat, "IntelGPUError"):  # helion imports on its own only on such a torch
            import helion._dist_utils as dist_utils
            assert dist_utils.kernel_uses_symm_mem(args), "without the function helion takes every kernel for symm-mem"
        import kernels_helion
        import helion._dist_utils as dist_utils
        from kernels_helion import torch_compat
        from kernels_helion._launch import bind_kernel
        from kernels_helion.quantize_rowwise import quantize_rowwise_rows_kernel
        assert "is_symm_mem_tensor" in torch_compat.SUPPLIED, torch_compat.SUPPLIED
        assert not symm_mem.is_symm_mem_tensor(args[0])
        assert not dist_utils.kernel_uses_symm_mem(args)
        stderr = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
            warnings.simplefilter("always")
            bound = bind_kernel(quantize_rowwise_rows_kernel, args)
        assert "flat" in bound.config_spec.allowed_pid_types, bound.config_spec.allowed_pid_types
        text = stderr.getvalue() + " ".join(str(w.message) for w in caught)
        assert "ProcessGroupNameNotFound" not in text and "max_num_sm_multipler" not in text, text
        dist.destroy_process_group()
        """
    )


def test_leaves_torch_own_intel_gpu_error_alone() -> None:
    _run_python(
        f"""
        import torch._inductor.runtime.triton_compat as triton_compat
        class Own(Exception):
            pass
        triton_compat.IntelGPUError = Own
        from kernels_helion import torch_compat
        assert torch_compat.SUPPLIED == (() if {TORCH_HAS_IS_SYMM_MEM_TENSOR} else ("is_symm_mem_tensor",)), torch_compat.SUPPLIED
        assert triton_compat.IntelGPUError is Own
        """
    )


@pytest.mark.cuda
@pytest.mark.skipif(TORCH_HAS_INTEL_GPU_ERROR, reason="for torch 2.11 (the GPU machine's): this torch defines IntelGPUError")
def test_gpu_torch_2_11_runs_helion_kernels_through_compat() -> None:
    # The GPU machine's own torch 2.11, untouched: helion loads through torch_compat, and a kernel
    # compiles and runs on the GPU, inside an NCCL process group with its flat program layout.
    _run_python(
        """
        import torch, torch.distributed as dist
        import torch._inductor.runtime.triton_compat as triton_compat
        import torch.distributed._symmetric_memory as symm_mem
        assert not hasattr(triton_compat, "IntelGPUError")
        assert not hasattr(symm_mem, "is_symm_mem_tensor")
        from kernels_helion import quantize_rowwise_rows
        from kernels_helion import torch_compat
        from kernels_helion._launch import bind_kernel
        from kernels_helion.quantize_rowwise import quantize_rowwise_rows_args, quantize_rowwise_rows_kernel
        from tests.support import free_port
        assert torch_compat.SUPPLIED == ("IntelGPUError", "is_symm_mem_tensor"), torch_compat.SUPPLIED
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        q, s = quantize_rowwise_rows(x)
        back = q.float() * s.float().reshape(-1, 1)
        assert torch.allclose(back, x.float(), rtol=0.07, atol=1e-3), (back - x.float()).abs().max()
        bound = bind_kernel(quantize_rowwise_rows_kernel, quantize_rowwise_rows_args(x))
        assert "flat" in bound.config_spec.allowed_pid_types, bound.config_spec.allowed_pid_types
        dist.destroy_process_group()
        """
    )
