"""Per-architecture kernel configs, shipped with the library, and the code that picks them.

Configs live in ``autotune_cache/<arch>/<kernel_name>.json`` as a list of entries
``{"key": {...}, "config": {...}}``; ``key`` holds the numbers that change the
best config (shape buckets, group count). At run time no search happens:
``select_config`` returns the entry with the exact key, else the nearest one (by
log-distance over the key's numbers), else the kernel's default config.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import helion
import torch

CACHE_DIR = Path(__file__).resolve().parent


def current_arch() -> str:
    """Architecture tag of the current device: ``sm90``, ``sm100``, ``gfx942``..., or ``cpu``."""
    if not torch.cuda.is_available():
        return "cpu"
    if torch.version.hip is not None:
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


@functools.cache
def load_entries(arch: str, kernel_name: str) -> tuple[tuple[dict[str, float], helion.Config], ...]:
    """Entries of ``<arch>/<kernel_name>.json`` (empty when the file does not exist)."""
    path = CACHE_DIR / arch / f"{kernel_name}.json"
    if not path.exists():
        return ()
    raw = json.loads(path.read_text())
    return tuple((dict(e["key"]), helion.Config(**e["config"])) for e in raw["entries"])


def _distance(a: dict[str, float], b: dict[str, float]) -> float:
    if a.keys() != b.keys():
        return math.inf
    return sum(abs(math.log2(max(a[k], 1)) - math.log2(max(b[k], 1))) for k in a)


def select_config(kernel_name: str, key: dict[str, float], default: helion.Config) -> helion.Config:
    """The shipped config for ``kernel_name`` nearest to ``key`` on this architecture, else ``default``."""
    entries = load_entries(current_arch(), kernel_name)
    if not entries:
        return default
    best_key, best_config = min(entries, key=lambda e: _distance(e[0], key))
    return best_config if _distance(best_key, key) < math.inf else default
