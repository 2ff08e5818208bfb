"""What helion 1.5 takes from torch but older supported torch releases lack.

- ``IntelGPUError``: helion 1.5 imports it from ``torch._inductor.runtime.triton_compat``,
  which torch 2.12 added. It is defined there when missing (as triton's own class
  when triton has one, else a plain ``Exception`` subclass, the way torch 2.12 does).
- ``torch.distributed._symmetric_memory.is_symm_mem_tensor`` (torch 2.12 added it):
  helion 1.5 asks it whether a kernel's arguments live in symmetric memory. Without
  it, helion takes *every* kernel compiled in a process with an initialized process
  group for a symmetric-memory kernel: it allows only persistent program layouts
  (a config tuned as one program per row or tile runs as one program per SM, 7-13x
  slower for the quantizers, measured on an H200 under torch 2.11) and warns
  ``ProcessGroupNameNotFound`` and ``max_num_sm_multipler is reduced`` at each
  compile. The function supplied answers from torch's own ``_SymmetricMemory``
  binding where that exists, else ``False``: this library allocates no symmetric
  memory, and on such a torch a Helion kernel of another library that takes
  symmetric-memory tensors in the same process needs torch 2.12 or later.

Each name is defined only when torch lacks it; nothing else in helion or torch is
changed. Import this module before helion and after ``TRITON_INTERPRET`` is
decided: ``torch._inductor.runtime.triton_compat`` imports triton, which reads that
variable once. ``kernels_helion.helion_setup`` does both in that order.
"""

from __future__ import annotations

import torch
import torch._inductor.runtime.triton_compat as _triton_compat

_supplied: list[str] = []

if not hasattr(_triton_compat, "IntelGPUError"):
    try:
        from triton.runtime.errors import IntelGPUError
    except ImportError:

        class IntelGPUError(Exception):  # type: ignore[no-redef]
            """Stand-in for triton's Intel GPU build error (never raised on NVIDIA or CPU)."""

    _triton_compat.IntelGPUError = IntelGPUError  # type: ignore[attr-defined]
    _supplied.append("IntelGPUError")

try:
    import torch.distributed._symmetric_memory as _symm_mem
except ImportError:  # a torch built without distributed: helion skips its symmetric-memory checks
    _symm_mem = None

if _symm_mem is not None and not hasattr(_symm_mem, "is_symm_mem_tensor"):
    _binding = getattr(getattr(_symm_mem, "_SymmetricMemory", None), "is_symm_mem_tensor", None)

    def is_symm_mem_tensor(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was allocated in symmetric memory (``False`` where torch cannot tell)."""
        return bool(_binding(tensor)) if _binding is not None else False

    _symm_mem.is_symm_mem_tensor = is_symm_mem_tensor  # type: ignore[attr-defined]
    _supplied.append("is_symm_mem_tensor")

SUPPLIED: tuple[str, ...] = tuple(_supplied)
"""The names this module had to define (empty on torch >= 2.12)."""
