"""What must hold before helion is first imported; ``kernels_helion`` imports this module first.

- With no CUDA device, the kernels run on CPU tensors through Triton's interpreter:
  ``TRITON_INTERPRET=1`` is set unless the variable is already set. Triton reads it
  once, when it first loads, so this has to precede helion (and triton).
- ``kernels_helion.torch_compat`` supplies the names helion 1.5 imports that older
  torch releases lack.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels_helion import torch_compat  # noqa: E402, F401
