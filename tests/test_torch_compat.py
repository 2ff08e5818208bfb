"""kernels_helion.torch_compat: helion 1.5 imports on torch releases that lack names it uses."""

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


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter from the repository root; fail with its output."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_supplies_only_the_missing_names() -> None:
    from torch._inductor.runtime import triton_compat

    assert torch_compat.SUPPLIED == (() if TORCH_HAS_INTEL_GPU_ERROR else ("IntelGPUError",))
    assert issubclass(triton_compat.IntelGPUError, Exception)


def test_defines_intel_gpu_error_before_helion_loads_when_torch_lacks_it() -> None:
    # torch 2.11 as helion sees it: the name removed before our package (and helion) first load.
    _run_python(
        """
        import sys
        import torch._inductor.runtime.triton_compat as triton_compat
        if hasattr(triton_compat, "IntelGPUError"):
            del triton_compat.IntelGPUError
        assert "helion" not in sys.modules
        import kernels_helion
        from kernels_helion import torch_compat
        import helion.autotuner.logger as logger
        assert torch_compat.SUPPLIED == ("IntelGPUError",), torch_compat.SUPPLIED
        assert logger.IntelGPUError is triton_compat.IntelGPUError
        assert issubclass(triton_compat.IntelGPUError, Exception)
        """
    )


def test_leaves_torch_own_intel_gpu_error_alone() -> None:
    _run_python(
        """
        import torch._inductor.runtime.triton_compat as triton_compat
        class Own(Exception):
            pass
        triton_compat.IntelGPUError = Own
        from kernels_helion import torch_compat
        assert torch_compat.SUPPLIED == ()
        assert triton_compat.IntelGPUError is Own
        """
    )


@pytest.mark.cuda
@pytest.mark.skipif(TORCH_HAS_INTEL_GPU_ERROR, reason="for torch 2.11 (the GPU machine's): this torch defines IntelGPUError")
def test_gpu_torch_2_11_runs_helion_kernels_through_compat() -> None:
    # The GPU machine's own torch 2.11, untouched: helion loads through torch_compat, and a kernel
    # compiles and runs on the GPU.
    _run_python(
        """
        import torch
        import torch._inductor.runtime.triton_compat as triton_compat
        assert not hasattr(triton_compat, "IntelGPUError")
        from kernels_helion import quantize_rowwise
        from kernels_helion import torch_compat
        assert torch_compat.SUPPLIED == ("IntelGPUError",)
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        q, s = quantize_rowwise(x)
        back = q.float() * s.float().reshape(-1, 1)
        assert torch.allclose(back, x.float(), rtol=0.07, atol=1e-3), (back - x.float()).abs().max()
        """
    )
