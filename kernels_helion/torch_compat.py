"""Names that helion 1.5 imports from torch but older supported torch releases lack.

helion 1.5 imports ``IntelGPUError`` from ``torch._inductor.runtime.triton_compat``,
which torch 2.12 added; torch 2.11 does not define it. This module defines that
one name there when it is missing (as triton's own class when triton has one,
else a plain ``Exception`` subclass, the way torch 2.12 does) and does nothing
when torch already has it. Nothing else in helion or torch is changed.

Import it before helion and after ``TRITON_INTERPRET`` is decided:
``torch._inductor.runtime.triton_compat`` imports triton, which reads that
variable once. ``kernels_helion.helion_setup`` does both in that order.
"""

from __future__ import annotations

import torch._inductor.runtime.triton_compat as _triton_compat

SUPPLIED: tuple[str, ...] = ()
"""The names this module had to define (empty on torch >= 2.12)."""

if not hasattr(_triton_compat, "IntelGPUError"):
    try:
        from triton.runtime.errors import IntelGPUError
    except ImportError:

        class IntelGPUError(Exception):  # type: ignore[no-redef]
            """Stand-in for triton's Intel GPU build error (never raised on NVIDIA or CPU)."""

    _triton_compat.IntelGPUError = IntelGPUError  # type: ignore[attr-defined]
    SUPPLIED = ("IntelGPUError",)
