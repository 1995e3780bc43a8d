"""The tuners' disk cache (:mod:`ninfer.kernels.tune_cache`) and its use by the GEMM selections, on CPU.

The cache directory is a temporary one (``NINFER_TUNE_CACHE``) and the GPU description behind the file
name (``tune_cache.file_parts``) is faked; a "new process" is simulated by ``tune_cache.forget()`` and
fresh selection dicts. The selection tests make the calls look tunable and fake the timing function,
so nothing is launched.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ninfer.kernels import tune_cache
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.moe.quant_gemv import (
    GROUPED_DOT,
    choose_config,
    expert_gemv_candidates,
)
from ninfer.kernels.quant_gemm.tune import GemmConfig, candidates, select_config
from ninfer.kernels.tuning import TunerState, default_tuner, use_tuner

DEV = torch.device("cuda", 0)  # only a key entry and an argument: nothing runs on it
KEY = ("int4-g64", torch.bfloat16, 1, 5120, 6144, True, False, DEV)
PARTS = {"gpu": "NVIDIA H200", "capability": "9.0", "triton": "3.8.0", "torch": "2.14.1", "kernels": "0123abcd"}


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The GPU and software description behind the file name: a fake H200, editable by the test."""
    parts = dict(PARTS)
    monkeypatch.setattr(tune_cache, "file_parts", lambda device: dict(parts))
    return parts


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: dict[str, str]) -> Path:
    """An empty cache directory and a fresh process state."""
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path))
    tune_cache.forget()
    yield tmp_path
    tune_cache.forget()


def _files(root: Path) -> list[Path]:
    return sorted(root.iterdir())


def test_round_trip_across_processes(cache_dir: Path) -> None:
    assert tune_cache.key_text(KEY) == '["int4-g64", "torch.bfloat16", 1, 5120, 6144, true, false]'
    assert tune_cache.lookup("t", KEY, DEV) is None
    tune_cache.record("t", KEY, {"block_m": 16, "kind": "gemv"}, DEV)
    assert tune_cache.lookup("t", KEY, DEV) == {"block_m": 16, "kind": "gemv"}
    [path] = _files(cache_dir)  # one file, no temporary left behind
    assert path.name.startswith("nvidia-h200-sm90-") and path.suffix == ".json"
    assert json.loads(path.read_text())["meta"] == PARTS
    tune_cache.forget()  # a new process
    assert tune_cache.lookup("t", KEY, DEV) == {"block_m": 16, "kind": "gemv"}
    other_gpu = (*KEY[:-1], torch.device("cuda", 3))  # same model: the device index is not part of the key
    assert tune_cache.lookup("t", other_gpu, torch.device("cuda", 3)) == {"block_m": 16, "kind": "gemv"}
    assert tune_cache.lookup("t", (*KEY[:1], torch.float16, *KEY[2:]), DEV) is None
    assert tune_cache.lookup("other", KEY, DEV) is None


@pytest.mark.parametrize("switch", ["off", "0", "OFF"])
def test_off_switch_neither_reads_nor_writes(cache_dir: Path, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    tune_cache.record("t", KEY, {"v": 1}, DEV)
    [path] = _files(cache_dir)
    before = path.read_text()
    tune_cache.forget()
    monkeypatch.setenv("NINFER_TUNE_CACHE", switch)
    assert tune_cache.cache_dir() is None
    assert tune_cache.lookup("t", KEY, DEV) is None
    tune_cache.record("t", KEY, {"v": 2}, DEV)
    assert _files(cache_dir) == [path] and path.read_text() == before


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NINFER_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune_cache.cache_dir() == tmp_path / "xdg" / "ninfer" / "tune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tune_cache.cache_dir() == tmp_path / "home" / ".cache" / "ninfer" / "tune"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"tables": [1]}', '{"tables": {"t": 3}}', "\xff\xfe"])
def test_corrupt_file_warns_once_and_is_replaced(cache_dir: Path, content: str) -> None:
    tune_cache.record("t", KEY, {"v": 1}, DEV)
    [path] = _files(cache_dir)
    path.write_bytes(content.encode("latin-1"))
    tune_cache.forget()
    with pytest.warns(RuntimeWarning, match="tune cache"):
        assert tune_cache.lookup("t", KEY, DEV) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        tune_cache.record("t", KEY, {"v": 2}, DEV)  # re-reads the corrupt file to merge: no second warning
    tune_cache.forget()
    assert tune_cache.lookup("t", KEY, DEV) == {"v": 2}  # the corrupt file was replaced


def test_unwritable_directory_never_raises(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = cache_dir / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(blocker / "tune"))  # a directory below a file: every access fails
    with pytest.warns(RuntimeWarning, match="tuning in memory only"):
        tune_cache.record("t", KEY, {"v": 1}, DEV)
    assert tune_cache.lookup("t", KEY, DEV) == {"v": 1}  # kept in memory for this process
    tune_cache.forget()
    with pytest.warns(RuntimeWarning):
        assert tune_cache.lookup("t", KEY, DEV) is None


def test_concurrent_writers_merge(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes read the (missing) file before either writes; the second writer keeps the first's entry."""
    key2 = (*KEY[:2], 2, *KEY[3:])
    first: dict = {}
    second: dict = {}
    monkeypatch.setattr(tune_cache, "_loaded", first)
    assert tune_cache.lookup("t", KEY, DEV) is None
    monkeypatch.setattr(tune_cache, "_loaded", second)
    assert tune_cache.lookup("moe", key2, DEV) is None
    tune_cache.record("moe", key2, {"v": 2}, DEV)
    monkeypatch.setattr(tune_cache, "_loaded", first)
    tune_cache.record("t", KEY, {"v": 1}, DEV)
    assert tune_cache.lookup("moe", key2, DEV) == {"v": 2}  # merged into this process's view as well
    monkeypatch.setattr(tune_cache, "_loaded", {})  # a third process
    assert tune_cache.lookup("t", KEY, DEV) == {"v": 1} and tune_cache.lookup("moe", key2, DEV) == {"v": 2}
    assert len(_files(cache_dir)) == 1


@pytest.mark.parametrize("part", list(PARTS))
def test_other_gpu_or_software_uses_another_file(cache_dir: Path, gpu: dict[str, str], part: str) -> None:
    tune_cache.record("t", KEY, {"v": 1}, DEV)
    tune_cache.forget()
    gpu[part] = "9.9" if part == "capability" else "changed"  # another GPU, Triton, torch or kernel source
    assert tune_cache.lookup("t", KEY, DEV) is None
    tune_cache.record("t", KEY, {"v": 2}, DEV)
    assert len(_files(cache_dir)) == 2
    tune_cache.forget()
    gpu[part] = PARTS[part]
    assert tune_cache.lookup("t", KEY, DEV) == {"v": 1}


def test_source_hash_covers_the_tuned_kernels_only(tmp_path: Path) -> None:
    digest = tune_cache.source_hash()
    assert len(digest) == 16 and int(digest, 16) >= 0
    for name in ("quant_gemm/gemm.py", "moe/quant_gemv.py", "attention/prefill.py", "dispatch.py", "tuning.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = tune_cache.source_hash(tmp_path)
    (tmp_path / "attention/prefill.py").write_text("x = 2\n")  # not tuned by these tables
    assert tune_cache.source_hash(tmp_path) == before
    for name in ("quant_gemm/gemm.py", "moe/quant_gemv.py", "dispatch.py", "tuning.py"):
        (tmp_path / name).write_text("x = 3\n")
        changed = tune_cache.source_hash(tmp_path)
        assert changed != before
        before = changed


def test_source_hash_tells_same_named_files_of_two_packages_apart(tmp_path: Path) -> None:
    for package in ("quant_gemm", "moe"):
        (tmp_path / package).mkdir()
    (tmp_path / "quant_gemm/dispatch.py").write_text("x = 1\n")
    one_side = tune_cache.source_hash(tmp_path)
    (tmp_path / "quant_gemm/dispatch.py").rename(tmp_path / "moe/dispatch.py")
    assert tune_cache.source_hash(tmp_path) != one_side


# --- the selections ---------------------------------------------------------------------------------


class AlwaysTunable(TunerState):
    """Every call may benchmark (as on a GPU with tuning on, not capturing), whatever its device."""

    def tunable(self, device: torch.device) -> bool:
        return True


@pytest.fixture
def tunable(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list]]:
    """Calls look tunable with every candidate offered, in a fresh tuner state; yields the list of
    candidate lists passed to the faked timing function."""
    timed: list[list] = []
    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda cfgs: cfgs)  # the interpreter keeps one
    tune_cache.forget()
    with use_tuner(AlwaysTunable()):
        yield timed


def new_process() -> None:
    """What a new process starts with: nothing read from disk, nothing chosen."""
    tune_cache.forget()
    default_tuner().clear()


def fake_timing(monkeypatch: pytest.MonkeyPatch, timed: list[list], fastest: GemmConfig | None) -> None:
    def time_candidates(cands: list[GemmConfig], launch, graphs: bool, cold: bool | None = None
                        ) -> dict[GemmConfig, float]:
        timed.append(list(cands))
        return {c: 0.5 if c == fastest else 1.0 + i for i, c in enumerate(cands)}

    monkeypatch.setattr(quant_gemm_tune, "time_candidates", time_candidates)


def test_select_config_takes_the_stored_config_without_timing(tunable: list[list],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 64)
    cands = candidates("int4-g64", 1, 32, 64, quant_gemm_tune.sm_count(x.device))
    fast = cands[-1]  # a GEMV: never the untuned default
    assert fast.kind.startswith("gemv")

    def select() -> GemmConfig:
        return select_config("int4-g64", x, 32, 64, False, True, lambda cfg: None)

    fake_timing(monkeypatch, tunable, fast)
    assert select() == fast and len(tunable) == 1
    new_process()
    fake_timing(monkeypatch, tunable, None)  # would now pick cands[0]
    assert select() == fast and len(tunable) == 1  # from disk, not timed
    key = ("int4-g64", torch.float32, 1, 32, 64, False, True, x.device, "rows")
    assert default_tuner().chosen("quant_gemm") == {key: fast}

    # A stored config that is no longer a candidate (or not a GemmConfig at all) is timed again and replaced.
    for stale in ({**asdict(fast), "block_n": 48}, {"block_m": 16, "warps": 4}):
        tune_cache.record("quant_gemm", key, stale, x.device)
        new_process()
        assert select() == cands[0] and len(tunable) == 2
        new_process()
        assert select() == cands[0] and len(tunable) == 2  # the new choice was stored
        tunable.pop()


def test_untunable_calls_never_touch_the_disk(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors (and the interpreter, capture, NINFER_QUANT_TUNE=0: all in TunerState.tunable) keep the
    favourite, even with tuning on."""
    def fail(*args: object) -> None:
        raise AssertionError("the disk cache was consulted")

    monkeypatch.setattr(tune_cache, "lookup", fail)
    monkeypatch.setattr(tune_cache, "record", fail)
    x = torch.zeros(1, 64)
    with use_tuner(TunerState(enabled=True)) as tuner:
        assert not tuner.tunable(x.device)
        assert select_config("int4-g64", x, 32, 64, False, False, lambda cfg: None) == \
            candidates("int4-g64", 1, 32, 64, 4)[0]
        rows = SimpleNamespace(direct=True, pairs=8, tune_m=8)
        assert choose_config("int4-g64", x, rows, 32, 64, True, lambda cfg: None) == GROUPED_DOT
        assert not tuner.chosen("quant_gemm") and not tuner.chosen("moe_gemv")
    assert not _files(cache_dir)


def test_choose_config_round_trips_the_dot_and_gemv_choices(tunable: list[list],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.zeros(1, 64)
    rows = SimpleNamespace(direct=True, pairs=8, tune_m=8)  # only what choose_config reads
    gemv = expert_gemv_candidates("int4-g64", 8, 32, 64, quant_gemm_tune.sm_count(a.device))[1]

    def choose(swiglu: bool) -> GemmConfig:
        return choose_config("int4-g64", a, rows, 32, 64, swiglu, lambda cfg: None)

    fake_timing(monkeypatch, tunable, gemv)
    assert choose(swiglu=True) == gemv
    fake_timing(monkeypatch, tunable, GROUPED_DOT)
    assert choose(swiglu=False) == GROUPED_DOT and len(tunable) == 2
    assert tunable[0][0] == GROUPED_DOT
    new_process()
    fake_timing(monkeypatch, tunable, None)
    assert choose(swiglu=True) == gemv and choose(swiglu=False) == GROUPED_DOT
    assert len(tunable) == 2 and not default_tuner().timings("moe_gemv")  # nothing timed in this "process"
    assert set(default_tuner().chosen("moe_gemv").values()) == {gemv, GROUPED_DOT}
    # a choice no longer among the candidates is timed again
    key = ("int4-g64", torch.float32, 8, 32, 64, True, a.device)
    tune_cache.record("moe_gemv", key, {**asdict(gemv), "split_k": 7}, a.device)
    new_process()
    assert choose(swiglu=True) == GROUPED_DOT and len(tunable) == 3  # fake_timing(None): cands[0] is fastest
