"""The tune command: ``python -m kernels_helion.tune [--kernels NAME ...] [--budget-s SECONDS] ...``.

Importing ``kernels_helion`` registers every kernel's search space and tuning shapes
(``autotune_cache.registry``); ``autotune_cache.tune.main`` then tunes them on the
current GPU and writes ``autotune_cache/<arch>/`` (``--help`` lists the options).
"""

from __future__ import annotations

import sys

import kernels_helion  # noqa: F401  (its kernel modules register their tuning)
from autotune_cache.tune import main

if __name__ == "__main__":
    sys.exit(main())
