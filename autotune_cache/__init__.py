"""Per-architecture kernel configs, shipped with the library, and the code that picks them.

Each launcher asks ``select_config(kernel_name, key, default)`` for its config;
no autotuning search ever runs in a normal call. Tuned configs live in
``autotune_cache/<arch>/<kernel_name>.json`` (written by ``python -m
kernels_helion.tune``)::

    {"kernel": "...", "arch": "sm90",
     "entries": [{"key": {"K": 5120}, "config": {<helion.Config as JSON>},
                  "gpu": "NVIDIA H200",
                  "versions": {"torch": "...", "triton": "...", "helion": "..."}, ...}]}

Each entry records the GPU model and the torch/triton/helion versions it was
tuned with: a re-tune of some shapes leaves the others' provenance as it was.
GPU models of one architecture share its file; a key may hold one entry per
model (an H100 and an H200 differ in memory bandwidth, which moves the best tile
of a memory-bound kernel).

``key`` holds the numbers that change the best config (shape buckets, group
count). Lookup: the entry with the exact key, else the nearest one (log2
distance over the key's numbers; keys with other names never match), else the
kernel's default config. Among entries of the chosen key, the one tuned on this
GPU model (``gpu`` as ``torch.cuda.get_device_name`` gives it) wins, else the
first in the file. An architecture with no cache directory uses the defaults and
warns once.

This package imports no kernel (nor ``ops``): the kernels import it. Importing it
changes nothing and loads no helion; reading a cache file imports helion, which
``kernels_helion`` sets up first (its launchers are the readers).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import helion

CACHE_DIR = Path(__file__).resolve().parent

# Set by ``forced_config`` (used by the tuner): kernel name -> config to return,
# and the keys that launchers asked for while it was active.
_forced: dict[str, helion.Config] = {}
_requested_keys: dict[str, dict[str, float]] = {}
# select_config's memo: (arch, gpu, kernel, key, id(default)) -> (entries, default, config).
_selected: dict[tuple, tuple] = {}
_MAX_SELECTED = 4096


def current_arch() -> str:
    """Architecture tag of the current device: ``sm90``, ``sm100``, ``gfx942``..., or ``cpu``."""
    if not _cuda_available():
        return "cpu"
    return _device_arch(torch.cuda.current_device())


@functools.cache
def _cuda_available() -> bool:
    # Cached: the query costs ~10 us (NVML) and launchers ask on every call; a process
    # does not gain or lose its GPUs.
    return torch.cuda.is_available()


def current_gpu() -> str:
    """The current device's model name (``torch.cuda.get_device_name``), ``""`` without a GPU."""
    if not _cuda_available():
        return ""
    return _device_name(torch.cuda.current_device())


@functools.cache
def _device_name(index: int) -> str:
    # Cached as the architecture is: launchers ask on every call.
    return torch.cuda.get_device_name(index)


@functools.cache
def _device_arch(index: int) -> str:
    # Cached: device queries cost tens of microseconds, and launchers ask on every call.
    if torch.version.hip is not None:
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def library_versions() -> dict[str, str]:
    """Versions of torch, triton and helion in use (helion has no ``__version__``)."""
    import importlib.metadata

    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "helion": importlib.metadata.version("helion")}


def cache_path(arch: str, kernel_name: str) -> Path:
    """Where the configs of ``kernel_name`` for ``arch`` are stored."""
    return CACHE_DIR / arch / f"{kernel_name}.json"


def read_cache_file(path: Path) -> dict:
    """Parse one cache file, checking its structure (``ValueError`` names what is wrong)."""
    raw = json.loads(path.read_text())
    for field in ("kernel", "arch", "entries"):
        if field not in raw:
            raise ValueError(f"{path}: missing field {field!r}")
    for i, entry in enumerate(raw["entries"]):
        if not {"key", "config", "gpu", "versions"} <= set(entry):
            raise ValueError(f"{path}: entry {i} needs 'key', 'config', 'gpu' and 'versions'")
        if not all(isinstance(v, (int, float)) for v in entry["key"].values()):
            raise ValueError(f"{path}: entry {i} key values must be numbers")
    return raw


@functools.cache
def load_entries(arch: str, kernel_name: str) -> tuple[tuple[dict[str, float], helion.Config, str], ...]:
    """``(key, config, gpu)`` entries for ``kernel_name`` on ``arch``, in file order (empty if none are shipped)."""
    path = cache_path(arch, kernel_name)
    if not path.exists():
        return ()
    import helion  # the caller (a launcher, the tuner) has imported kernels_helion: helion is set up

    raw = read_cache_file(path)
    return tuple((dict(e["key"]), helion.Config.from_dict(e["config"]), e["gpu"]) for e in raw["entries"])


@functools.cache
def _warn_if_arch_uncached(arch: str) -> None:
    if arch != "cpu" and not (CACHE_DIR / arch).is_dir():
        warnings.warn(
            f"autotune_cache has no configs for {arch}: kernels use their default configs. "
            "Run `python -m kernels_helion.tune` to tune this GPU.",
            stacklevel=3,
        )


def key_distance(a: dict[str, float], b: dict[str, float]) -> float:
    """log2 distance between two keys; infinite when they name different quantities."""
    if a.keys() != b.keys():
        return math.inf
    return sum(abs(math.log2(max(a[k], 1)) - math.log2(max(b[k], 1))) for k in a)


def select_config(kernel_name: str, key: dict[str, float], default: helion.Config) -> helion.Config:
    """The config to run ``kernel_name`` with for ``key`` on this architecture and GPU model."""
    if _forced:
        _requested_keys[kernel_name] = dict(key)
        if kernel_name in _forced:
            return _forced[kernel_name]
    arch = current_arch()
    _warn_if_arch_uncached(arch)
    entries = load_entries(arch, kernel_name)
    if not entries:
        return default
    # Launchers ask on every call: remember the choice per key, for these very entries
    # (``load_entries.cache_clear()`` yields new ones, which invalidates the memo).
    gpu = current_gpu()
    memo_key = (arch, gpu, kernel_name, tuple(key.items()), id(default))
    memo = _selected.get(memo_key)
    if memo is not None and memo[0] is entries and memo[1] is default:
        return memo[2]
    # The nearest key; among its entries, this GPU model's (min keeps the first of equals).
    best_key, best_config, _ = min(entries, key=lambda e: (key_distance(e[0], key), e[2] != gpu))
    config = best_config if key_distance(best_key, key) < math.inf else default
    if len(_selected) >= _MAX_SELECTED:  # keys vary with the routing (token counts): start over
        _selected.clear()
    _selected[memo_key] = (entries, default, config)
    return config


@contextlib.contextmanager
def forced_config(kernel_name: str, config: helion.Config) -> Iterator[dict[str, dict[str, float]]]:
    """Make launchers of ``kernel_name`` run ``config``; yields the keys they asked for."""
    _forced[kernel_name] = config
    _requested_keys.clear()
    try:
        yield _requested_keys
    finally:
        del _forced[kernel_name]
