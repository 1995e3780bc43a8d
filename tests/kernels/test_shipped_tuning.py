"""The shipped per-GPU tuning tables (:mod:`ninfer.kernels.shipped`), on CPU.

The GPU model is faked (``shipped.gpu_identity``: an H200 for every device) and the tables' folder is a
temporary one, so nothing depends on what the package ships. The runtime tuners are driven with a tuner
state that may time (its timing function records what it was given); the ``triton.autotune`` side runs a real
:class:`ShippedAutotuner` over a stand-in kernel object (as ``test_compile_watch`` does), so no kernel runs.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import triton

from ninfer.kernels import autotune, compile_watch, precompile, shipped, shipped_export, tune_cache, tuning
from ninfer.kernels.autotune import ShippedAutotuner, ninfer_autotune, tuning_key
from ninfer.kernels.tuning import TunerState, use_tuner

ROOT = Path(__file__).resolve().parents[2]
DEV = torch.device("cuda", 0)  # only a key entry and an argument: nothing runs on it
KEY = ("int4-g64", torch.bfloat16, 1, 5120, 6144, True, False, DEV, "rows")
H200 = ("NVIDIA H200", "9.0")


@dataclass(frozen=True)
class Cfg:
    block: int
    warps: int


A, B, C = Cfg(16, 4), Cfg(32, 4), Cfg(64, 8)


class Tunable(TunerState):
    """A tuner state that may time (as on a GPU)."""

    def tunable(self, device: torch.device) -> bool:
        return True


@pytest.fixture
def h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty shipped folder, every device an H200, the switch on and an empty user tune cache."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    monkeypatch.setattr(shipped, "folder", lambda: folder)
    monkeypatch.setattr(shipped, "gpu_identity", lambda device: H200)
    monkeypatch.setenv(shipped.ENV, "1")
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(tune_cache, "file_parts", lambda device: {"gpu": H200[0], "capability": H200[1]})
    shipped.forget()
    tune_cache.forget()
    yield folder
    shipped.forget()
    tune_cache.forget()


def _ship(folder: Path, tables: dict | None = None, autotuned: dict | None = None) -> None:
    doc = {"meta": {"gpu": H200[0], "capability": H200[1], "sources": []}, "tables": tables or {},
           "autotune": autotuned or {}}
    (folder / "nvidia-h200-sm90.json").write_text(json.dumps(doc))
    shipped.forget()  # a new process


def _choose(state: TunerState, timed: list[list[Cfg]], key: tuple = KEY) -> Cfg:
    def time_fn(cands: list[Cfg]) -> dict[Cfg, float]:
        timed.append(list(cands))
        return {c: float(i) for i, c in enumerate(cands)}
    return state.choose("quant_gemm", key, lambda: [A, B, C], time_fn, DEV)


# -- runtime tuners ------------------------------------------------------------------------------------------

def test_a_shipped_choice_answers_a_key_the_user_cache_misses_and_times_nothing(h200: Path) -> None:
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): {"block": 64, "warps": 8}}})
    state, timed = Tunable(), []
    with compile_watch.watch() as w:
        assert _choose(state, timed) == C and _choose(state, timed) == C
    assert timed == [] and state.sources("quant_gemm") == {KEY: tuning.SHIPPED}
    assert [(e.kind, e.name) for e in w.events] == [(compile_watch.TUNE_SHIPPED, "quant_gemm")]
    assert "1 from the shipped table (1 tuner keys, 0 triton.autotune keys)" in w.summary()
    assert not (h200.parent / "user").exists()  # a shipped choice is not copied into the user's cache


def test_the_user_cache_comes_before_the_shipped_table(h200: Path) -> None:
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): {"block": 64, "warps": 8}}})
    tune_cache.record("quant_gemm", KEY, {"block": 32, "warps": 4}, DEV)
    tune_cache.forget()
    state, timed = Tunable(), []
    with compile_watch.watch() as w:
        assert _choose(state, timed) == B
    assert timed == [] and state.sources("quant_gemm") == {KEY: tuning.STORED}
    assert [e.kind for e in w.events] == [compile_watch.TUNE_LOADED]


@pytest.mark.parametrize("fields", [{"block": 128, "warps": 8}, {"block": 64, "warps": 8, "split": 2}, {}])
def test_a_shipped_config_that_is_no_candidate_is_ignored(h200: Path, fields: dict) -> None:
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): fields}})
    state, timed = Tunable(), []
    assert _choose(state, timed) == A and timed == [[A, B, C]]
    assert state.sources("quant_gemm") == {KEY: tuning.TIMED}


@pytest.mark.parametrize("switch", ["0", "off"])
def test_the_switch_turns_the_tables_off_per_call(h200: Path, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): {"block": 64, "warps": 8}}})
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")  # the timed choice is not stored for the second state
    monkeypatch.setenv(shipped.ENV, switch)
    timed: list[list[Cfg]] = []
    assert _choose(Tunable(), timed) == A and timed == [[A, B, C]]
    monkeypatch.setenv(shipped.ENV, "1")
    assert _choose(Tunable(), timed := []) == C and timed == []


def test_untunable_calls_take_the_shipped_choice_else_the_favourite(h200: Path) -> None:
    other = (*KEY[:2], 2, *KEY[3:])
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): {"block": 64, "warps": 8}}})
    state, timed = TunerState(), []  # on CPU (no GPU to time on): never tunable
    with compile_watch.watch() as w:
        assert _choose(state, timed) == C and _choose(state, timed) == C
        assert _choose(state, timed, other) == A
    assert timed == [] and state.chosen("quant_gemm") == {} and state.favourite("quant_gemm", KEY) == C
    assert [e.kind for e in w.events] == [compile_watch.TUNE_SHIPPED]  # once per key


def test_the_dry_tuner_requests_only_the_shipped_config_and_leaves_the_choice_to_the_real_pass(h200: Path) -> None:
    _ship(h200, {"quant_gemm": {tune_cache.key_text(KEY): {"block": 32, "warps": 4}}})
    real, timed = Tunable(), []
    assert _choose(precompile.DryTuner(real), timed) == B and timed == [[B]]
    assert real.chosen("quant_gemm") == {}
    untunable = TunerState()
    assert _choose(precompile.DryTuner(untunable), timed := []) == B and timed == []
    assert untunable.favourite("quant_gemm", KEY) is None  # the real pass chooses, and counts, it
    with compile_watch.watch() as w:
        assert _choose(untunable, []) == B
    assert [e.kind for e in w.events] == [compile_watch.TUNE_SHIPPED]


def test_no_table_for_this_gpu_changes_nothing(h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert shipped.table(DEV) == {}  # the folder holds no file
    monkeypatch.setattr(shipped, "folder", lambda: h200 / "missing")
    shipped.forget()
    assert shipped.table(DEV) == {} and _choose(Tunable(), timed := []) == A and timed == [[A, B, C]]


def test_a_malformed_table_is_ignored_with_one_warning(h200: Path) -> None:
    (h200 / "nvidia-h200-sm90.json").write_text('{"meta": {}, "tables": []}')
    with pytest.warns(RuntimeWarning, match="ignoring the shipped tuning table"):
        assert shipped.table(DEV) == {}
    assert _choose(Tunable(), timed := []) == A and timed == [[A, B, C]]


def test_a_real_cpu_device_has_no_gpu_model() -> None:
    shipped.forget()
    assert shipped.gpu_identity(torch.device("cpu")) is None and shipped.table_stem(torch.device("cpu")) is None


# -- triton.autotune kernels ---------------------------------------------------------------------------------

class _StandIn:
    """What an autotuner wraps: ``fn`` (the Python function, for its name and module) and ``run`` (the launch)."""

    def __init__(self) -> None:
        self.fn, self.arg_names, self.launches = self._kernel, ["x", "N", "FLAG", "BLOCK"], []

    @staticmethod
    def _kernel(x, N, FLAG, BLOCK):  # noqa: N803 (Triton argument names)
        pass

    def run(self, *args, **kwargs) -> None:
        self.launches.append((kwargs["BLOCK"], kwargs["num_warps"]))


CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4, num_stages=1), triton.Config({"BLOCK": 32}, num_warps=4),
           triton.Config({"BLOCK": 64}, num_warps=8, num_stages=2)]


def _tuner(monkeypatch: pytest.MonkeyPatch, configs: list = CONFIGS, prune: dict | None = None,
           benchmarks: list | None = None) -> ShippedAutotuner:
    monkeypatch.setattr(autotune, "_registry", {})
    def do_bench(fn, quantiles):  # the first config benchmarked is the fastest
        fn()
        if benchmarks is None:
            pytest.fail("a shipped key benchmarks nothing")
        benchmarks.append(1)
        return [float(len(benchmarks))] * 3
    return ninfer_autotune(configs, key=["N", "FLAG"], name="standin", prune_configs_by=prune,
                           do_bench=do_bench)(_StandIn())


def _entry(tuner: ShippedAutotuner, key: tuple, config: triton.Config) -> dict:
    return {tuner.ninfer_name: {shipped.autotune_key_text(key): shipped.config_fields(config)}}


def test_the_key_is_the_one_triton_files_the_choice_under(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner, x = _tuner(monkeypatch, benchmarks=[]), torch.zeros(4, dtype=torch.bfloat16)
    tuner.run(x, 64, grid=(1,), FLAG=True)
    assert list(tuner.cache) == [tuning_key(tuner.arg_names, tuner.keys, {"x": x, "N": 64}, {"grid": (1,),
                                                                                           "FLAG": True})]
    assert list(tuner.cache) == [(64, True, "torch.bfloat16")]
    assert shipped.autotune_key_text((64, True, "torch.bfloat16")) == '[64, true, "torch.bfloat16"]'
    assert tuner.ninfer_name.endswith(".standin") and autotune.registered() == {tuner.ninfer_name: tuner}


def test_a_shipped_autotune_config_is_taken_without_benchmarking(h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuner, x = _tuner(monkeypatch), torch.zeros(4)
    _ship(h200, autotuned=_entry(tuner, (64, False, "torch.float32"), CONFIGS[2]))
    lookups = []
    lookup = shipped.autotune_lookup
    monkeypatch.setattr(shipped, "autotune_lookup", lambda *a: lookups.append(a) or lookup(*a))
    with compile_watch.watch() as w:
        tuner.run(x, 64, grid=(1,), FLAG=False)
        tuner.run(x, 64, grid=(1,), FLAG=False)  # a known key: Triton's cache, nothing looked up
    assert tuner.fn.launches == [(64, 8), (64, 8)] and tuner.cache[(64, False, "torch.float32")] is CONFIGS[2]
    assert [(e.kind, e.name) for e in w.events] == [(compile_watch.AUTOTUNE_SHIPPED, tuner.ninfer_name)]
    assert len(lookups) == 1


def test_a_triton_that_times_a_lone_config_gets_the_shipped_one_untimed(
        h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6 benchmarks a single pruned config: ``_bench`` answers for the shipped pick, not launching."""
    tuner, x = _tuner(monkeypatch, benchmarks=[]), torch.zeros(4)
    _ship(h200, autotuned=_entry(tuner, (64, True, "torch.float32"), CONFIGS[1]))
    tuner.nargs = {"x": x, "N": 64}
    [pick] = tuner.prune_configs({"grid": (1,), "FLAG": True})
    assert pick is CONFIGS[1] and tuner._bench(x, 64, config=pick, FLAG=True) == [0.0, 0.0, 0.0]
    assert tuner.fn.launches == []
    assert tuner._bench(x, 64, config=CONFIGS[0], FLAG=True) == [1.0, 1.0, 1.0]  # any other: Triton's timing
    assert tuner.fn.launches == [(16, 4)]


def test_the_prune_step_keeps_only_a_shipped_config_that_survives_the_kernels_own(
        h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def small_blocks(configs: list, named_args: dict, **kwargs: object) -> list:
        return [c for c in configs if c.kwargs["BLOCK"] <= named_args["N"]]

    tuner, x = _tuner(monkeypatch, prune={"early_config_prune": small_blocks}), torch.zeros(4)
    block_32 = shipped.config_fields(triton.Config({"BLOCK": 32}, num_warps=4))  # CONFIGS[1]'s fields
    entries = {(64, True, "torch.float32"): block_32, (16, True, "torch.float32"): block_32,
               (128, True, "torch.float32"): {**shipped.config_fields(CONFIGS[2]), "num_stages": 3}}
    _ship(h200, autotuned={tuner.ninfer_name: {shipped.autotune_key_text(k): v for k, v in entries.items()}})

    def prune(n: int) -> list:  # what Autotuner.run and the dry pass call, with the call's named arguments
        tuner.nargs = {"x": x, "N": n}
        return tuner.prune_configs({"grid": (1,), "FLAG": True})

    assert prune(64) == [CONFIGS[1]] and prune(64)[0] is CONFIGS[1]  # the kernel's own config object
    assert prune(16) == [CONFIGS[0]]  # shipped BLOCK=32 was pruned away for N=16: the kernel's own pruning
    assert prune(128) == CONFIGS  # other stages: not one of the configs
    assert prune(256) == CONFIGS  # no entry
    monkeypatch.setenv(shipped.ENV, "0")
    assert prune(64) == CONFIGS  # off: the kernel's own pruning only


def test_a_multi_config_kernel_without_an_entry_still_benchmarks(h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    benchmarks: list[int] = []
    tuner = _tuner(monkeypatch, benchmarks=benchmarks)
    _ship(h200, autotuned=_entry(tuner, (64, True, "torch.float32"), CONFIGS[2]))
    tuner.run(torch.zeros(4), 32, grid=(1,), FLAG=True)  # another key
    assert len(benchmarks) == 3 and tuner.cache[(32, True, "torch.float32")] is CONFIGS[0]


def test_a_single_config_kernel_never_looks(h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipped, "autotune_lookup", lambda *a: pytest.fail("no key, no lookup"))
    tuner = _tuner(monkeypatch, configs=CONFIGS[:1])  # the interpreter's and NINFER_AUTOTUNE=off's case
    tuner.run(torch.zeros(4), 64, grid=(1,), FLAG=True)
    assert tuner.fn.launches == [(16, 4)] and tuner.cache == {}


def test_the_dry_pass_requests_only_the_shipped_config_and_chooses_nothing(
        h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = _tuner(monkeypatch)
    _ship(h200, autotuned=_entry(tuner, (64, True, "torch.float32"), CONFIGS[1]))
    with precompile.dry_launches():
        tuner[(1,)](torch.zeros(4), 64, FLAG=True)
    assert tuner.fn.launches == [(32, 4)] and tuner.cache == {}
    with compile_watch.watch() as w:  # the real pass takes (and counts) it
        tuner[(1,)](torch.zeros(4), 64, FLAG=True)
    assert [e.kind for e in w.events] == [compile_watch.AUTOTUNE_SHIPPED]


def test_every_autotuned_kernel_of_ninfer_is_registered() -> None:
    import ninfer  # noqa: F401 (imports every kernel module)

    names = set(autotune.registered())
    assert {"ninfer.kernels.attention.prefill._prefill_kernel", "ninfer.kernels.deltanet.chunk._state_kernel",
            "ninfer.kernels.moe.gemm._gemm_skinny", "ninfer.kernels.moe.quant_gemm._gemm_tiled"} <= names
    assert len(names) == 13
    assert all(isinstance(t, ShippedAutotuner) for t in autotune.registered().values())


# -- export, ship, package data ------------------------------------------------------------------------------

def test_export_then_ship_round_trip(h200: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    import ship_tuning

    tuner = _tuner(monkeypatch, benchmarks=[])
    tuner.run(torch.zeros(4, dtype=torch.bfloat16), 64, grid=(1,), FLAG=True)  # benchmarked: the first config
    state = Tunable()
    _choose(state, [])  # timed: A
    out = tmp_path / "export.json"
    with use_tuner(state):
        first = shipped_export.export(out, DEV, meta={"run": "27b"})
    assert shipped.validate(first) == [] and first["meta"]["sources"][0]["run"] == "27b"
    assert first["tables"] == {"quant_gemm": {tune_cache.key_text(KEY): {"block": 16, "warps": 4}}}
    assert first["autotune"] == _entry(tuner, (64, True, "torch.bfloat16"), CONFIGS[0])

    other = (*KEY[:2], 4, *KEY[3:])
    _choose(state, [], other)
    second = shipped_export.export(out, DEV, tuner=state, meta={"run": "35b"})  # accumulates over the file
    assert [s["run"] for s in second["meta"]["sources"]] == ["27b", "35b"]
    assert len(second["tables"]["quant_gemm"]) == 2

    ship_tuning.ship([out], dest=h200)
    assert shipped.counts(json.loads((h200 / "nvidia-h200-sm90.json").read_text())) == {
        "quant_gemm": 2, f"autotune:{tuner.ninfer_name}": 1}
    shipped.forget()  # a new process on the same GPU model: shipped, not timed
    assert _choose(Tunable(), timed := [], other) == A and timed == []
    fresh = _tuner(monkeypatch)
    fresh.run(torch.zeros(4, dtype=torch.bfloat16), 64, grid=(1,), FLAG=True)
    assert fresh.fn.launches == [(16, 4)]


def test_ship_refuses_a_malformed_file_and_writes_nothing(h200: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    import ship_tuning

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "capability": "9.0"},
                               "autotune": {"k": {"[1]": {"num_warps": 4}}}}))
    assert ship_tuning.main([str(bad), "--dest", str(h200)]) == 1 and not any(h200.iterdir())


def test_the_perf_hook_exports_only_when_asked(h200: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    import common

    out = tmp_path / "hook.json"
    monkeypatch.delenv("NINFER_EXPORT_TUNING", raising=False)
    common.export_tuning("cuda")
    monkeypatch.setenv("NINFER_EXPORT_TUNING", str(out))
    common.export_tuning("cpu")
    assert not out.exists()
    common.export_tuning("cuda")
    assert shipped.validate(json.loads(out.read_text())) == []


def test_the_package_folder_is_found_and_packaged() -> None:
    folder = shipped.folder()
    assert folder.is_dir() and folder.joinpath("README.md").is_file()
    assert Path(str(folder)) == ROOT / "ninfer" / "kernels" / "tuned"
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ninfer"]
    for path in Path(str(folder)).iterdir():  # every table (and the README) goes into wheels and sdists
        rel = path.relative_to(ROOT / "ninfer").as_posix()
        assert any(fnmatch(rel, p) for p in patterns), rel
        if path.suffix == ".json":  # a shipped table: valid and named for its GPU model
            doc = json.loads(path.read_text())
            assert shipped.validate(doc) == [], path
            assert path.stem == tune_cache.gpu_stem(doc["meta"]["gpu"], doc["meta"]["capability"])
    assert any(fnmatch("kernels/tuned/nvidia-h200-sm90.json", p) for p in patterns)


@pytest.mark.parametrize("switch", ["NINFER_AUTOTUNE=off", "NINFER_QUANT_TUNE=0"])
def test_untimed_choices_are_never_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str,
                                            capsys: pytest.CaptureFixture) -> None:
    """A benchmark that took the first candidates unmeasured exports nothing (the runbook may have set the export
    for a whole call, its GPU tests and first-config stages included)."""
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    import common

    out = tmp_path / "export.json"
    monkeypatch.setenv("NINFER_EXPORT_TUNING", str(out))
    monkeypatch.setenv(*switch.split("="))
    monkeypatch.setattr(shipped_export, "export", lambda *a, **k: pytest.fail("untimed choices exported"))
    common.export_tuning("cuda")
    assert not out.exists() and f"{switch} (untimed choices)" in capsys.readouterr().out


def test_the_runbook_asks_whether_this_gpu_has_a_table(h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``perf/unshipped_gpu.py``: 0 (export) for a GPU model without a shipped table, 1 for one with a table and
    for a machine without CUDA."""
    monkeypatch.syspath_prepend(str(ROOT / "perf"))
    import unshipped_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert unshipped_gpu.main() == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shipped, "folder", lambda: h200)
    (h200 / "nvidia-h200-sm90.json").write_text("{}")
    for gpu, want in (("nvidia-h200-sm90", 1), ("nvidia-h100-80gb-hbm3-sm90", 0)):
        monkeypatch.setattr(shipped, "table_stem", lambda device, gpu=gpu: gpu)
        assert unshipped_gpu.main() == want, gpu
