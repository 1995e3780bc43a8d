"""The tuners' state (:mod:`ninfer.kernels.tuning`) on its own: choices, favourites, the on/off switch, the
process default. Timing functions are faked and the disk cache is a temporary directory; nothing launches."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ninfer.kernels import tune_cache, tuning
from ninfer.kernels.tuning import TunerState, default_tuner, use_tuner

GPU = torch.device("cuda", 0)  # only a key entry and an argument: nothing runs on it


@dataclass(frozen=True)
class Cfg:
    tile: int
    warps: int = 4


CANDS = [Cfg(16), Cfg(32), Cfg(64, 8)]


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune_cache, "file_parts", lambda device: {"gpu": "NVIDIA H200", "capability": "9.0"})
    tune_cache.forget()
    yield tmp_path
    tune_cache.forget()


class Calls:
    """Counts candidate-list builds and timings; ``fastest`` is the candidate the fake timing favours."""

    def __init__(self, fastest: Cfg) -> None:
        self.fastest, self.built, self.timed = fastest, 0, 0

    def candidates(self) -> list[Cfg]:
        self.built += 1
        return list(CANDS)

    def time(self, cands: list[Cfg]) -> dict[Cfg, float]:
        self.timed += 1
        return {c: 0.5 if c == self.fastest else 1.0 for c in cands}


def test_a_tunable_call_times_once_and_keeps_the_fastest(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = TunerState(enabled=True)
    monkeypatch.setattr(tuning, "on_gpu", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls = Calls(fastest=CANDS[2])
    assert tuner.choose("t", ("k", GPU), calls.candidates, calls.time, GPU) == CANDS[2]
    assert tuner.choose("t", ("k", GPU), calls.candidates, calls.time, GPU) == CANDS[2]
    assert (calls.built, calls.timed) == (1, 1)
    assert tuner.chosen("t") == {("k", GPU): CANDS[2]} and tuner.chosen("other") == {}
    assert tuner.timings("t") == {("k", GPU): {CANDS[0]: 1.0, CANDS[1]: 1.0, CANDS[2]: 0.5}}
    # a fresh state (a new process) takes the stored choice without timing; the file holds the fields
    fresh = TunerState(enabled=True)
    assert fresh.choose("t", ("k", GPU), calls.candidates, Calls(CANDS[0]).time, GPU) == CANDS[2]
    assert calls.timed == 1 and fresh.timings("t") == {} and fresh.chosen("t") == {("k", GPU): CANDS[2]}
    assert tune_cache.lookup("t", ("k", GPU), GPU) == {"tile": 64, "warps": 8}
    tuner.clear()
    assert tuner.chosen("t") == {} and tuner.timings("t") == {}


def test_untunable_calls_take_the_favourite_and_build_the_list_once(disk: Path) -> None:
    """On CPU (or under capture, or with tuning off) the first candidate, kept per key; a key with one
    candidate is never timed either; nothing reaches the disk."""
    tuner = TunerState(enabled=True)
    calls = Calls(fastest=CANDS[2])
    cpu = torch.device("cpu")
    for _ in range(3):
        assert tuner.choose("t", ("k",), calls.candidates, calls.time, cpu) == CANDS[0]
    assert (calls.built, calls.timed) == (1, 0) and tuner.chosen("t") == {}
    assert not list(disk.iterdir())


def test_a_single_candidate_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = TunerState(enabled=True)
    monkeypatch.setattr(tuner, "tunable", lambda device: True)
    calls = Calls(fastest=CANDS[0])
    assert tuner.choose("t", ("k",), lambda: [CANDS[1]], calls.time, GPU) == CANDS[1]
    assert calls.timed == 0 and tuner.chosen("t") == {}


def test_no_candidate_that_runs_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = TunerState(enabled=True)
    monkeypatch.setattr(tuner, "tunable", lambda device: True)
    monkeypatch.setattr(tuning, "stored_config", lambda *args: None)
    with pytest.raises(RuntimeError, match="no t config fits this GPU"):
        tuner.choose("t", ("k",), lambda: list(CANDS), lambda cands: {}, GPU)


def test_the_switch_reads_the_environment_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "on_gpu", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tuner = TunerState()
    monkeypatch.delenv("NINFER_QUANT_TUNE", raising=False)
    assert tuner.tuning_on() and tuner.tunable(GPU)
    monkeypatch.setenv("NINFER_QUANT_TUNE", "0")
    assert not tuner.tuning_on() and not tuner.tunable(GPU)
    assert TunerState(enabled=True).tunable(GPU)  # an explicit switch wins over the environment
    monkeypatch.setenv("NINFER_QUANT_TUNE", "1")
    assert not TunerState(enabled=False).tunable(GPU)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not tuner.tunable(GPU)  # never inside graph capture


def test_use_tuner_swaps_the_process_default_and_restores_it() -> None:
    before = default_tuner()
    mine = TunerState()
    with use_tuner(mine) as state:
        assert state is mine and default_tuner() is mine
        with pytest.raises(KeyError), use_tuner(TunerState()):
            raise KeyError("restored on errors too")
        assert default_tuner() is mine
    assert default_tuner() is before


def test_the_quant_gemm_tuner_uses_the_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """select_config's choice lands in default_tuner()'s "quant_gemm" table (and nowhere once swapped out)."""
    from ninfer.kernels.quant_gemm import tune as quant_gemm_tune

    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda cfgs: cfgs)
    monkeypatch.setattr(quant_gemm_tune, "time_candidates",
                        lambda cands, launch, graphs: {c: 0.5 if i == 1 else 1.0 for i, c in enumerate(cands)})
    monkeypatch.setattr(tuning, "stored_config", lambda *args: None)
    monkeypatch.setattr(tune_cache, "record", lambda *args: None)
    x = torch.zeros(2, 64)
    with use_tuner(TunerState()) as tuner:
        monkeypatch.setattr(tuner, "tunable", lambda device: True)
        cfg = quant_gemm_tune.select_config("int4-g64", x, 32, 64, False, False, lambda c: None)
        assert cfg == quant_gemm_tune.candidates("int4-g64", 2, 32, 64, 4)[1]
        key = ("int4-g64", torch.float32, 2, 32, 64, False, False, x.device, "rows")
        assert tuner.chosen("quant_gemm") == {key: cfg}
    assert key not in default_tuner().chosen("quant_gemm")


def test_graph_bound_prefill_keys_are_tuned_apart_without_the_dequantization_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-size call that a CUDA graph will capture (the prompt-chunk graph) cannot take the dequantization
    path: its key is marked "graph" and tuned among the register decodes, the 64-token one and the tiled GEMMs
    (the last candidates, fastest here), while the eager key keeps its own choice; where the dequantization's
    workspace already holds the weight, a graph key times that path too; decode sizes keep one key."""
    from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
    from ninfer.kernels.quant_gemm.fragments import FRAGMENTS

    timed: list[list] = []

    def fastest_last(cands: list, launch: object, graphs: bool) -> dict:  # as measured: dequantization first
        timed.append(cands)
        return {c: 0.01 if c.kind == "dequant" else 1.0 / (i + 1) for i, c in enumerate(cands)}

    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda cfgs: cfgs)
    monkeypatch.setattr(quant_gemm_tune, "time_candidates", fastest_last)
    monkeypatch.setattr(tuning, "stored_config", lambda *args: None)
    monkeypatch.setattr(tuning, "shipped_config", lambda *args: None)
    monkeypatch.setattr(tune_cache, "record", lambda *args: None)
    x = torch.zeros(128, 5120, dtype=torch.bfloat16)
    with use_tuner(TunerState()) as tuner:
        monkeypatch.setattr(tuner, "tunable", lambda device: True)
        eager = quant_gemm_tune.select_config("int4-g64", x, 5120, 5120, False, False, lambda c: None, FRAGMENTS)
        graph = quant_gemm_tune.select_config("int4-g64", x, 5120, 5120, False, False, lambda c: None, FRAGMENTS,
                                              graph=True)
        assert eager.kind == "dequant" and graph.kind.startswith("frag-tiled")
        kinds = {"frag", "frag-pair", "frag-tiled", "frag-tiled-codes"}
        assert {c.kind for c in timed[1]} == kinds and len(timed[1]) > 2
        assert any(c.kind == "frag" and c.block_m == quant_gemm_tune.WIDE_FRAG_TOKENS for c in timed[1])
        keys = set(tuner.chosen("quant_gemm"))
        assert {k[-1] for k in keys} == {FRAGMENTS, "graph"}
        held = quant_gemm_tune.select_config("int4-g64", x, 6144, 5120, False, False, lambda c: None, FRAGMENTS,
                                             graph=True, dequant_in_graph=True)  # its workspace holds the weight
        assert held.kind == "dequant" and "dequant" in {c.kind for c in timed[-1]}
        small = torch.zeros(8, 5120, dtype=torch.bfloat16)
        quant_gemm_tune.select_config("int4-g64", small, 5120, 5120, False, False, lambda c: None, FRAGMENTS,
                                      graph=True)
        assert len(tuner.chosen("quant_gemm")) == 4 and all(k[-1] != "graph" for k in tuner.chosen("quant_gemm")
                                                            if k[2] == 8)


def test_a_key_with_one_candidate_builds_its_candidates_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fragment-laid weights above FRAG_PREFILL_MAX_M tokens have one candidate (the dequantization path), so the
    tuner never stores a choice for them and asks for the list on every tunable call: it is built once per
    distinct call (it took ~0.25 ms of Python a GEMM), and the same list comes back."""
    from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
    from ninfer.kernels.quant_gemm.fragments import FRAGMENTS

    built: list[int] = []
    real = quant_gemm_tune.fragment_layout_candidates

    def counted(*args: object, **kwargs: object) -> list:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_gemm_tune, "fragment_layout_candidates", counted)
    monkeypatch.setattr(tuning, "stored_config", lambda *args: None)
    monkeypatch.setattr(tune_cache, "record", lambda *args: None)
    x = torch.zeros(1024, 5120, dtype=torch.bfloat16)
    n_out = 5120 + 16 * 7  # a shape no other test asks for: the lists are cached per process
    with use_tuner(TunerState()) as tuner:
        monkeypatch.setattr(tuner, "tunable", lambda device: True)
        picks = [quant_gemm_tune.select_config("nvfp4", x, n_out, 5120, False, True, lambda c: None, FRAGMENTS)
                 for _ in range(5)]
        assert len(built) == 1 and {c.kind for c in picks} == {"dequant"} and len(set(picks)) == 1
        assert tuner.chosen("quant_gemm") == {}  # one candidate: nothing was timed or stored
