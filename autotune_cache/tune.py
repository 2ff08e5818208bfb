"""The tuner: tune the registered kernels on the current GPU and write this architecture's cache.

    python -m kernels_helion.tune [--kernels NAME ...] [--budget-s SECONDS] [--max-shapes N]
                                  [--shapes K=V,... ...]

That command imports ``kernels_helion``, whose kernel modules register their search
spaces and tuning shapes (``autotune_cache.registry``), then runs ``main``; this
module imports no kernel.

For each kernel and shape, every config of the kernel's search space runs through
the public launcher; its output must match the default config's; the fastest (GPU
time of its kernels, CUDA-graph replays from a cold L2:
``autotune_cache.timing.bench_kernel_us``, so a launcher's host side does not hide
the kernel's differences) is stored with its key in
``autotune_cache/<arch>/<kernel>.json``; the entry records the GPU's name and the
torch/triton/helion versions. Existing entries with other keys, or tuned on another
GPU model of the architecture, are kept, with their own records.
The cache's current config for a shape is timed right after the default, so a
re-tune that runs out of budget keeps it unless a config it reached is faster.
To contribute a new GPU: run this on it and commit the new ``autotune_cache/<arch>/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from autotune_cache import (
    cache_path,
    current_arch,
    forced_config,
    library_versions,
    load_entries,
    read_cache_file,
    select_config,
)
from autotune_cache.registry import TunableKernel, tunable_kernels
from autotune_cache.timing import bench_kernel_us


def _outputs_match(a: object, b: object, exact: bool, chunk: int = 1 << 26) -> bool:
    """Whether a config's outputs equal the default's (``exact``) or are close to them. Compared in
    float32 chunks of ``chunk`` elements: a fine-grained wgrad's whole output in float32 would not fit
    beside the operands (256 x 4096 x 7168 is 28 GiB)."""
    if isinstance(a, (tuple, list)):
        return all(_outputs_match(x, y, exact, chunk) for x, y in zip(a, b))
    for x, y in zip(a.reshape(-1).split(chunk), b.reshape(-1).split(chunk)):  # type: ignore[union-attr]
        x, y = x.float(), y.float()
        same = ((x == y) | (x.isnan() & y.isnan())).all() if exact else torch.allclose(
            x, y, rtol=1e-2, atol=1e-2, equal_nan=True
        )
        if not same:
            return False
    return True


def copied_outputs(out: object) -> object:
    """``out`` (a tensor, or a tuple or list of them) cloned: a tuning call may return a buffer it
    reuses (the accumulating wgrad adds into one gradient), which later calls would change."""
    if isinstance(out, (tuple, list)):
        return tuple(copied_outputs(t) for t in out)
    return out.clone()  # type: ignore[union-attr]


def parse_shape_filter(text: str) -> dict[str, int]:
    """``"M=32768,K=7168"`` -> ``{"M": 32768, "K": 7168}`` (for ``--shapes``)."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return {name.strip(): int(value) for name, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} is not of the form NAME=INT,NAME=INT") from None


def shape_selected(shape: dict[str, int], filters: list[dict[str, int]]) -> bool:
    """Whether ``shape`` matches one of ``filters`` (every named size equal); no filters: all."""
    return not filters or any(all(shape.get(k) == v for k, v in f.items()) for f in filters)


def tune_shape(spec: TunableKernel, shape: dict[str, int], arch: str, deadline: float) -> dict:
    """The best entry for one shape (the default is always timed; others until ``deadline``)."""
    device = torch.device("cuda")
    call = spec.make_call(shape, device)
    with forced_config(spec.name, spec.default_config) as keys:
        reference = copied_outputs(call())
        key = dict(keys[spec.name])
        default_us = bench_kernel_us(call)
    best_us, best = default_us, spec.default_config
    incumbent_us = default_us
    # The cache's current config goes first: a budget-limited re-tune then never
    # stores a config slower than the one it replaces.
    incumbent = select_config(spec.name, key, spec.default_config)
    candidates = [incumbent] + [c for c in spec.space(arch)[1:] if c != incumbent]
    for i, config in enumerate(c for c in candidates if c != spec.default_config):
        if time.monotonic() > deadline:
            print(f"    budget reached after {i} configs besides the default", flush=True)
            break
        try:
            with forced_config(spec.name, config):
                if not _outputs_match(call(), reference, spec.exact):
                    print(f"    config {i}: output differs from the default's, skipped", flush=True)
                    continue
                us = bench_kernel_us(call)
        except Exception as e:  # a config the compiler rejects is skipped, not fatal
            print(f"    config {i}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if config == incumbent:
            incumbent_us = us
        if us < best_us:
            best_us, best = us, config
    print(f"  {shape} key={key}: default {default_us:.1f} us, selected before {incumbent_us:.1f} us, "
          f"best {best_us:.1f} us: {dict(best.config)}", flush=True)
    return {"key": key, "config": dict(best.config), "time_us": round(best_us, 2),
            "default_time_us": round(default_us, 2), "selected_before_time_us": round(incumbent_us, 2), "shape": shape,
            "gpu": torch.cuda.get_device_name(), "versions": library_versions()}


def write_cache(spec: TunableKernel, arch: str, new_entries: list[dict]) -> None:
    """Merge ``new_entries`` into the kernel's cache file for ``arch`` (same key and GPU model: replaced;
    other models' entries for the key are kept)."""
    path = cache_path(arch, spec.name)
    old = read_cache_file(path)["entries"] if path.exists() else []
    by_key: dict[tuple[str, str], dict] = {}
    for entry in old + new_entries:  # a later entry with the same key and GPU replaces an earlier one
        by_key[json.dumps(entry["key"], sort_keys=True), entry["gpu"]] = entry
    entries = list(by_key.values())
    payload = {
        "kernel": spec.name,
        "arch": arch,
        "entries": sorted(entries, key=lambda e: (sorted(e["key"].items()), e["gpu"])),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    load_entries.cache_clear()


def main(argv: list[str] | None = None) -> int:
    """Tune the registered kernels (``--help`` lists the options); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="total time budget in seconds")
    parser.add_argument("--max-shapes", type=int, default=None, help="tune at most this many shapes per kernel")
    parser.add_argument(
        "--shapes",
        nargs="*",
        type=parse_shape_filter,
        default=[],
        metavar="K=V,...",
        help="tune only the registry shapes that match one of these (e.g. M=32768,K=7168,G=8 E=8,N=2048); "
        "kernels with no matching shape are skipped",
    )
    args = parser.parse_args(argv)
    specs = tunable_kernels()
    if not specs:
        print("no kernel is registered: run `python -m kernels_helion.tune`, which imports the kernels", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tuning needs a GPU", file=sys.stderr)
        return 2
    names = args.kernels or list(specs)
    unknown = sorted(set(names) - set(specs))
    if unknown:
        parser.error(f"unknown kernels {unknown}; known: {sorted(specs)}")
    arch = current_arch()
    plan = [(specs[name], [s for s in specs[name].shapes if shape_selected(s, args.shapes)][: args.max_shapes])
            for name in names]
    for spec, shapes in plan:
        if not shapes:
            print(f"{spec.name}: no shape matches --shapes, skipped", flush=True)
    plan = [(spec, shapes) for spec, shapes in plan if shapes]
    # The budget is shared among the shapes in proportion to their kernels' space sizes.
    work_left = sum(len(spec.space(arch)) * len(shapes) for spec, shapes in plan)
    start = time.monotonic()
    for n, (spec, shapes) in enumerate(plan):
        size = len(spec.space(arch))
        print(f"[{n + 1}/{len(plan)}] {spec.name}: {size} configs x {len(shapes)} shapes", flush=True)
        entries = []
        for shape in shapes:
            budget_left = args.budget_s - (time.monotonic() - start)
            shape_deadline = time.monotonic() + budget_left * size / work_left
            work_left -= size
            entries.append(tune_shape(spec, shape, arch, shape_deadline))
        write_cache(spec, arch, entries)
        print(f"  wrote {cache_path(arch, spec.name)}", flush=True)
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
