from __future__ import annotations

import json
import warnings

import helion
import pytest
import torch
from triton.runtime.errors import OutOfResources

import autotune_cache
from autotune_cache import CACHE_DIR, forced_config, key_distance, read_cache_file, select_config
from autotune_cache.registry import tunable_kernels
from kernels_helion.tuning import vary
from tests.reference import ref_quantize_rowwise
from tests.support import DEVICE, ON_GPU, assert_fp8_equal

DEFAULT = helion.Config(block_sizes=[1], num_warps=4)
SMALL = helion.Config(block_sizes=[2], num_warps=4)
LARGE = helion.Config(block_sizes=[4], num_warps=8)
WIDE = helion.Config(block_sizes=[8], num_warps=2)


def install_fake_cache(tmp_path, monkeypatch, entries: list[tuple[int, helion.Config, str]]) -> None:
    """A cache file for kernel 'k' on arch 'sm90', selected as the current arch: ``(K, config, gpu)`` entries."""
    (tmp_path / "sm90").mkdir()
    payload = {
        "kernel": "k", "arch": "sm90",
        "entries": [
            {"key": {"K": k}, "config": dict(config.config), "gpu": gpu, "versions": {}} for k, config, gpu in entries
        ],
    }
    (tmp_path / "sm90" / "k.json").write_text(json.dumps(payload))
    monkeypatch.setattr(autotune_cache, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(autotune_cache, "current_arch", lambda: "sm90")
    autotune_cache.load_entries.cache_clear()


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """Two entries for kernel 'k': K=1024 and K=8192."""
    install_fake_cache(tmp_path, monkeypatch, [(1024, SMALL, "test"), (8192, LARGE, "test")])
    yield
    autotune_cache.load_entries.cache_clear()


def test_exact_key(fake_cache):
    assert select_config("k", {"K": 8192}, DEFAULT) == LARGE


def test_nearest_key(fake_cache):
    assert select_config("k", {"K": 2048}, DEFAULT) == SMALL
    assert select_config("k", {"K": 6000}, DEFAULT) == LARGE


@pytest.fixture
def two_gpu_cache(tmp_path, monkeypatch):
    """Kernel 'k' with key K=1024 tuned on two GPU models and K=8192 on one."""
    install_fake_cache(tmp_path, monkeypatch, [(1024, SMALL, "GPU A"), (1024, LARGE, "GPU B"), (8192, WIDE, "GPU B")])
    yield
    autotune_cache.load_entries.cache_clear()


@pytest.mark.parametrize("gpu, expected", [("GPU A", SMALL), ("GPU B", LARGE), ("GPU C", SMALL), ("", SMALL)])
def test_entry_of_this_gpu_model_wins_among_one_key(two_gpu_cache, monkeypatch, gpu, expected):
    """Among entries of the nearest key, this GPU model's; a model with none takes the first in the file.
    The nearest key still comes first: K=6000 is nearest to K=8192, tuned on GPU B only."""
    monkeypatch.setattr(autotune_cache, "current_gpu", lambda: gpu)
    assert select_config("k", {"K": 1024}, DEFAULT) == expected
    assert select_config("k", {"K": 2048}, DEFAULT) == expected
    assert select_config("k", {"K": 6000}, DEFAULT) == WIDE


def test_other_key_names_fall_back_to_default(fake_cache):
    assert select_config("k", {"N": 8192}, DEFAULT) == DEFAULT


def test_unknown_kernel_falls_back_to_default(fake_cache):
    assert select_config("other", {"K": 8192}, DEFAULT) == DEFAULT


def test_uncached_arch_warns_once(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune_cache, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(autotune_cache, "current_arch", lambda: "sm999")
    autotune_cache._warn_if_arch_uncached.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_config("k", {"K": 1}, DEFAULT) == DEFAULT
        assert select_config("k", {"K": 2}, DEFAULT) == DEFAULT
    assert [str(w.message) for w in caught if "sm999" in str(w.message)].__len__() == 1
    autotune_cache._warn_if_arch_uncached.cache_clear()


def test_key_distance():
    assert key_distance({"K": 4}, {"K": 4}) == 0
    assert key_distance({"K": 4}, {"K": 16}) == 2
    assert key_distance({"K": 4}, {"N": 4}) == float("inf")


def test_forced_config_reports_the_launchers_key():
    from kernels_helion import quantize_rowwise_rows
    from kernels_helion.quantize_rowwise import DEFAULT_CONFIG

    with forced_config("quantize_rowwise_rows", DEFAULT_CONFIG) as keys:
        quantize_rowwise_rows(torch.randn(3, 40, device=DEVICE))
    assert keys["quantize_rowwise_rows"] == {"M": 3, "K": 40}


def test_vary_keeps_default_first_and_unique():
    configs = vary(DEFAULT, num_warps=[4, 8], block_sizes=[[1], [2]])
    assert configs[0] == DEFAULT
    assert len(configs) == len(set(configs)) == 4


def test_spaces_contain_defaults():
    for spec in tunable_kernels().values():
        for arch in ("sm90", "sm100", "gfx942"):
            space = spec.space(arch)
            assert space[0] == spec.default_config, (spec.name, arch)


def _shipped_files():
    return sorted(p for p in CACHE_DIR.glob("*/*.json"))


@pytest.mark.parametrize("path", _shipped_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_cache_file_is_valid(path):
    raw = read_cache_file(path)
    specs = tunable_kernels()
    assert raw["kernel"] == path.stem and raw["kernel"] in specs, f"{path}: unknown kernel"
    assert raw["arch"] == path.parent.name
    spec = specs[raw["kernel"]]
    import kernels_helion._launch as launch_module
    from autotune_cache.tune import copied_outputs

    # Each form of the launcher's key (its names) with a small call of that form and its default output.
    forms: dict[frozenset, tuple] = {}
    for shape in (spec.test_shape, *spec.other_test_shapes):
        call = spec.make_call(shape, DEVICE)
        with forced_config(spec.name, spec.default_config):
            reference = copied_outputs(call())
        with forced_config(spec.name, spec.default_config) as keys:
            before = set(launch_module._compiled)
            call()
        # The same call again takes launch's fast path for each of its launches: no launcher hands it
        # a new config object (or anything else new) per call.
        assert set(launch_module._compiled) <= before, f"{spec.name}: a repeated call bound and looked its kernels up again"
        forms[frozenset(keys[spec.name])] = (call, reference)
    # Many keys share a config: each distinct one is compiled and run once per form.
    configs: dict[tuple[frozenset, str], dict] = {}
    for entry in raw["entries"]:
        assert entry["gpu"] and {"torch", "triton", "helion"} <= set(entry["versions"]), f"{path}: provenance"
        form = frozenset(entry["key"])
        assert form in forms, f"{path}: key {entry['key']} is not of the launcher's form"
        configs.setdefault((form, json.dumps(entry["config"], sort_keys=True)), entry["config"])
    for (form, _), fields in configs.items():
        call, reference = forms[form]
        config = helion.Config.from_dict(fields)
        with forced_config(spec.name, config):  # compiles and runs: invalid fields raise here
            out = call()
        outs = out if isinstance(out, tuple) else (out,)
        refs = reference if isinstance(reference, tuple) else (reference,)
        for a, b in zip(outs, refs):
            torch.testing.assert_close(a.float(), b.float(), equal_nan=True)


def test_normal_calls_never_search(monkeypatch):
    from helion.runtime.kernel import BoundKernel

    from kernels_helion import quantize_rowwise_rows

    def no_search(*args, **kwargs):
        raise AssertionError("an autotuning search was started")

    monkeypatch.setattr(BoundKernel, "autotune", no_search)
    monkeypatch.setenv("HELION_DISALLOW_AUTOTUNING", "1")
    quantize_rowwise_rows(torch.randn(7, 33, device=DEVICE))


def test_write_cache_merges_entries_by_key(tmp_path, monkeypatch):
    from autotune_cache.tune import write_cache

    monkeypatch.setattr(autotune_cache, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    spec = tunable_kernels()["quantize_rowwise_rows"]
    def entry(m: int, warps: int, helion_version: str) -> dict:
        config = {"block_sizes": [1], "num_warps": warps}
        return {"key": {"M": m, "K": 64}, "config": config, "gpu": "test GPU", "versions": {"helion": helion_version}}

    write_cache(spec, "sm90", [entry(1, 4, "1.4.0"), entry(2, 4, "1.4.0")])
    write_cache(spec, "sm90", [entry(2, 8, "1.5.1"), entry(3, 8, "1.5.1"), entry(3, 16, "1.5.1")])
    raw = read_cache_file(tmp_path / "sm90" / "quantize_rowwise_rows.json")
    warps = {e["key"]["M"]: e["config"]["num_warps"] for e in raw["entries"]}
    assert warps == {1: 4, 2: 8, 3: 16}
    # Each entry keeps the versions it was tuned with.
    assert {e["key"]["M"]: e["versions"]["helion"] for e in raw["entries"]} == {1: "1.4.0", 2: "1.5.1", 3: "1.5.1"}
    autotune_cache.load_entries.cache_clear()


def test_write_cache_keeps_other_gpu_models_entries(tmp_path, monkeypatch):
    """A re-tune on one GPU model replaces that model's entry for a key and keeps another model's."""
    from autotune_cache.tune import write_cache

    monkeypatch.setattr(autotune_cache, "CACHE_DIR", tmp_path)
    spec = tunable_kernels()["quantize_rowwise_rows"]

    def entry(gpu: str, warps: int) -> dict:
        return {"key": {"M": 1, "K": 64}, "config": {"block_sizes": [1], "num_warps": warps}, "gpu": gpu, "versions": {}}

    write_cache(spec, "sm90", [entry("GPU B", 4)])
    write_cache(spec, "sm90", [entry("GPU A", 8)])
    write_cache(spec, "sm90", [entry("GPU A", 16)])
    raw = read_cache_file(tmp_path / "sm90" / "quantize_rowwise_rows.json")
    assert [(e["gpu"], e["config"]["num_warps"]) for e in raw["entries"]] == [("GPU A", 16), ("GPU B", 4)]
    autotune_cache.load_entries.cache_clear()


def test_tune_shape_filter():
    import argparse

    from autotune_cache.tune import parse_shape_filter, shape_selected

    filters = [parse_shape_filter("M=32768,K=7168"), parse_shape_filter("E=8")]
    assert filters == [{"M": 32768, "K": 7168}, {"E": 8}]
    assert shape_selected({"M": 32768, "K": 7168, "G": 8}, filters)
    assert shape_selected({"E": 8, "N": 2048, "K": 7168}, filters)
    assert not shape_selected({"M": 32768, "K": 2048, "G": 8}, filters)
    assert not shape_selected({"N": 8, "K": 7168}, filters)  # a named size the shape lacks never matches
    assert shape_selected({"M": 1}, [])
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=INT"):
        parse_shape_filter("M32768")


def test_importing_the_lookup_has_no_side_effect():
    """``import autotune_cache`` sets no environment variable and loads neither helion nor triton;
    ``import kernels_helion`` picks the interpreter exactly when there is no GPU."""
    import os
    import subprocess
    import sys

    code = (
        "import os, sys, torch\n"
        "import autotune_cache\n"
        "assert 'TRITON_INTERPRET' not in os.environ, 'autotune_cache set TRITON_INTERPRET'\n"
        "assert not {'helion', 'triton'} & set(sys.modules), 'autotune_cache loaded helion or triton'\n"
        "import kernels_helion\n"
        "assert os.environ.get('TRITON_INTERPRET') == (None if torch.cuda.is_available() else '1')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_tuner_compares_outputs_chunk_by_chunk():
    """The tuner's check of a config's output against the default's looks at every chunk."""
    from autotune_cache.tune import _outputs_match

    a = torch.randn(3, 50, dtype=torch.bfloat16)
    a[0, 0] = float("nan")
    assert _outputs_match(a, a.clone(), exact=True, chunk=16)
    for index in ((0, 1), (2, 49)):  # first and last chunk
        b = a.clone()
        b[index] += 1
        assert not _outputs_match(a, b, exact=True, chunk=16)
        assert not _outputs_match((a, a), (a, b), exact=False, chunk=16)
    close = a.float().mul(1 + 1e-3).to(torch.bfloat16)
    assert _outputs_match(a, close, exact=False, chunk=16)


def test_config_that_does_not_fit_shared_memory_loses_stages(monkeypatch):
    """A tuned config that needs more shared memory for this call (e.g. an fp32 epilogue) drops stages until it fits."""
    import kernels_helion._launch as launch_module
    from kernels_helion.quantize_rowwise import DEFAULT_CONFIG, quantize_rowwise_rows_args, quantize_rowwise_rows_kernel

    tried = []

    class FakeBound:
        def compile_config(self, config):
            def run(*args, _launcher):
                tried.append(config.config["num_stages"])
                if config.config["num_stages"] > 2:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return "ran"

            return run

    monkeypatch.setattr(launch_module, "bind_kernel", lambda kernel, args: FakeBound())
    monkeypatch.setattr(launch_module, "_compiled", {})
    config = helion.Config(**{**DEFAULT_CONFIG.config, "num_stages": 4})
    args = quantize_rowwise_rows_args(torch.randn(3, 5))
    assert launch_module.launch(quantize_rowwise_rows_kernel, args, config) == "ran"
    assert tried == [4, 3, 2]
    assert launch_module.launch(quantize_rowwise_rows_kernel, args, config) == "ran"  # the fast path keeps the fit
    assert tried == [4, 3, 2, 2]

    # One stage that still does not fit: Triton's error reaches the caller.
    one_stage = helion.Config(**{**DEFAULT_CONFIG.config, "num_stages": 1})
    monkeypatch.setattr(launch_module, "bind_kernel", lambda kernel, args: NeverFits())
    with pytest.raises(OutOfResources):
        launch_module.launch(quantize_rowwise_rows_kernel, (torch.randn(4, 5), *args[1:]), one_stage)


class NeverFits:
    def compile_config(self, config):
        def run(*args, _launcher):
            raise OutOfResources(300_000, 232_448, "shared memory")

        return run


def test_repeated_launches_of_one_signature_use_the_new_inputs():
    """The launch fast path (on a GPU: the Triton kernel launched directly) computes on each call's own data.

    Also an input whose data is not 16-byte aligned (Triton specializes kernels on
    alignment) gets its own entry and the right result.
    """
    import kernels_helion._launch as launch_module
    from kernels_helion import quantize_rowwise_rows

    torch.manual_seed(0)
    flat = torch.randn(3 * 40 * 64 + 1, device=DEVICE)
    inputs = [torch.randn(40, 64, device=DEVICE) for _ in range(3)] + [flat[1:].view(3, 40, 64)[1]]
    for x in inputs + inputs[:1]:
        q, scales = quantize_rowwise_rows(x)
        q_ref, scales_ref = ref_quantize_rowwise(x, torch.float8_e4m3fn, False)
        assert torch.equal(scales, scales_ref)
        assert_fp8_equal(q, q_ref)
    if ON_GPU:
        launchers = [entry[3] for entry in launch_module._compiled.values()]
        assert any(launcher.kernels for launcher in launchers), "no kernel is launched directly"


def test_a_new_token_count_reuses_the_compiled_function(monkeypatch):
    """A call signature that differs only in sizes (token counts change every step) skips Helion's compile lookup."""
    from helion.runtime.kernel import BoundKernel

    from kernels_helion import quantize_rowwise_rows

    compiles = []
    original = BoundKernel.compile_config

    def counted(self, config, **kwargs):
        compiles.append(config)
        return original(self, config, **kwargs)

    monkeypatch.setattr(BoundKernel, "compile_config", counted)
    torch.manual_seed(0)
    for rows in (72, 40, 56):
        x = torch.randn(rows, 48, device=DEVICE)
        q, scales = quantize_rowwise_rows(x)
        q_ref, scales_ref = ref_quantize_rowwise(x, torch.float8_e4m3fn, False)
        assert torch.equal(scales, scales_ref)
        assert_fp8_equal(q, q_ref)
    assert len(compiles) <= 1, f"the compile lookup ran for {len(compiles)} of 3 token counts"


@pytest.mark.cuda
def test_launch_hooks_see_every_launch():
    """With a Triton launch hook installed (profilers), launches go through Triton's run and call it."""
    from triton import knobs

    from kernels_helion import quantize_rowwise_rows

    x = torch.randn(24, 80, device=DEVICE)
    quantize_rowwise_rows(x)  # after this first call, the signature's kernel is launched directly
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        quantize_rowwise_rows(x)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


def test_profile_kernel_command(capsys):
    """``benchmarks.profile_kernel`` checks its arguments, then makes the tuner's call (on a GPU)."""
    from benchmarks import profile_kernel

    with pytest.raises(SystemExit):
        profile_kernel.main(["no_such_kernel", "M=5,K=96"])
    with pytest.raises(SystemExit):
        profile_kernel.main(["quantize_rowwise_rows", "M=5"])
    assert "missing ['K']" in capsys.readouterr().err
    if not ON_GPU:
        with pytest.raises(SystemExit):
            profile_kernel.main(["quantize_rowwise_rows", "M=5,K=96"])
        assert "needs a GPU" in capsys.readouterr().err
        return
    assert profile_kernel.main(["quantize_rowwise_rows", "M=5,K=96", "--calls", "2"]) == 0
    assert "2 calls" in capsys.readouterr().out
