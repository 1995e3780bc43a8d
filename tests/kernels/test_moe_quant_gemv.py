"""The expert decode GEMV (:mod:`ninfer.kernels.moe.quant_gemv`) in the Triton interpreter, and its selection.

Every quantized format against dequantize + ``moe_experts_reference`` in fp32, fp32 and fp16
activations, 1..8 tokens, both epilogues (gate/up SwiGLU, down times the routing weight). H and I
are multiples of each format's group but mostly not of BLOCK_K (ragged K steps; fp8-b128 also a
partial 128-block); routing leaves experts 0 and 5 without tokens and sends most tokens to expert 3,
so experts hold several pairs (more than BLOCK_M in places). Outputs, intermediates and the split-K
scratch are NaN-poisoned. The selection tests fake the timings and the GPU.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kernel_testing import (  # noqa: F401  (poisoned_outputs: a fixture)
    EXPERT_TOL as TOL,
    check_quant_experts,
    expert_routing,
    expert_stacks,
    nan_experts,
    poisoned_outputs,
)

from ninfer.kernels.moe import quant_gemm as moe_quant_gemm
from ninfer.kernels.quant_gemm import timing as quant_gemm_timing
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import moe_experts_reference
from ninfer.kernels.moe.align import ExpertRows, expert_rows
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.quant_gemv import (
    GROUPED_DOT,
    MAX_PAIRS,
    choose_config,
    expert_gemv_candidates,
)
from ninfer.kernels import tuning
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.kernels.tuning import TunerState, use_tuner

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K = 8, 2
SHAPES = {  # format: (H, I), as in test_moe_quant
    "fp8": (192, 96), "fp8-b128": (192, 96), "int8-g32": (160, 96), "int8-g64": (192, 64),
    "int4-g64": (192, 64), "int4-g128": (256, 128), "nvfp4": (176, 48),
}
BK = {"int4-g128": 128, "fp8-b128": 128}  # K step: the format's group where it exceeds 64


def _gemv(fmt: str, block_m: int, block_n: int, split: int, kind: str = "gemv") -> GemmConfig:
    return GemmConfig(block_m, block_n, BK.get(fmt, 64), split, 4, 1, kind)


# (tokens, config): one pair per pass, two (a partial second row), four with prefetch; split-K 1 and > 1
CASES = [(1, (1, 16, 1)), (3, (2, 32, 2)), (8, (4, 16, 3, "gemv-prefetch"))]


@pytest.fixture
def no_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned GEMV must not fall back to the tl.dot kernels."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tl.dot expert GEMM ran")

    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", fail)




def _check(fmt: str, dtype: torch.dtype, n: int, path: str | GemmConfig, seed: int = 0,
           ids: torch.Tensor | None = None) -> None:
    check_quant_experts(fmt, *SHAPES[fmt], dtype, n, path, seed=seed, ids=ids, e=E, k=K)


@pytest.mark.usefixtures("no_dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_gemv_matches_reference(fmt: str, dtype: torch.dtype) -> None:
    cases = CASES + ([(5, (2, 16, 2, "gemv-w32")), (2, (1, 32, 1, "gemv-w32"))] if fmt.startswith("int4") else [])
    for n, cfg in cases:
        _check(fmt, dtype, n, _gemv(fmt, *cfg), seed=n)


@pytest.mark.usefixtures("no_dot")
@pytest.mark.parametrize("n", range(1, 9))
def test_one_to_eight_tokens_default_candidate(n: int) -> None:
    """path="gemv": the first candidate (one K step of 512 here: H and I are single ragged steps)."""
    _check("int4-g64", torch.float32, n, "gemv", seed=10 + n)
    _check("fp8-b128", torch.float16, n, _gemv("fp8-b128", 2, 16, 2), seed=20 + n)


@pytest.mark.usefixtures("no_dot")
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "nvfp4", "fp8"])
def test_shared_expert_and_repeated_slot(fmt: str) -> None:
    """Hand-made int32 ids: five tokens on expert 6 (nine pairs: passes of 2, the last partial), a
    token listing expert 6 in both slots, one pair on expert 2; all other experts idle."""
    ids = torch.full((5, K), 6, dtype=torch.int32)
    ids[0, 1] = 2
    words = [(2, 16, 2, "gemv-w32")] if fmt.startswith("int4") else []
    for cfg in [(2, 16, 1), (4, 32, 2, "gemv-prefetch"), (1, 16, 3), *words]:
        _check(fmt, torch.float32, 5, _gemv(fmt, *cfg), seed=3, ids=ids)


@pytest.mark.usefixtures("no_dot")
@pytest.mark.parametrize("fmt", ["int8-g32", "nvfp4", "fp8", "fp8-b128"])
def test_experts_without_tokens_are_never_read(fmt: str) -> None:
    """NaN in every float tensor of experts 0 and 5 (no tokens): the output is exactly the clean one."""
    h, i = SHAPES[fmt]
    stacks = expert_stacks(fmt, E, h, i, seed=9)
    weights, ids = expert_routing(4, E, K)
    assert not ((ids == 0) | (ids == 5)).any()
    poisoned = nan_experts(stacks, [0, 5])
    x = torch.randn(4, h)
    cfg = _gemv(fmt, 2, 16, 2)
    assert torch.equal(moe_experts_triton(x, *poisoned, weights, ids, path=cfg),
                       moe_experts_triton(x, *stacks, weights, ids, path=cfg))


def test_path_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """"dot" never runs the GEMV; "gemv" on aligned rows (prefill) runs the dot; a GEMV config there
    raises; unknown paths raise."""
    h, i = SHAPES["int8-g64"]
    gate_up, down = expert_stacks("int8-g64", E, h, i)
    weights, ids = expert_routing(3, E, K)
    x = torch.randn(3, h)
    ran: list[str] = []
    dot, gemv = moe_quant_gemm._launch_dot, moe_quant_gemm.launch_expert_gemv
    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", lambda *a, **k: (ran.append("dot"), dot(*a, **k)))
    monkeypatch.setattr(moe_quant_gemm, "launch_expert_gemv", lambda *a, **k: (ran.append("gemv"), gemv(*a, **k)))
    ref = moe_experts_reference(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    for path, want in (("dot", "dot"), ("gemv", "gemv"), (None, "dot")):  # None: auto, untuned on CPU
        ran.clear()
        got = moe_experts_triton(x, gate_up, down, weights, ids, path=path)
        assert ran == [want, want] and (got - ref).norm() / ref.norm() < TOL[torch.float32], path
    monkeypatch.setattr("ninfer.kernels.moe.gemm.DIRECT_MAX_PAIRS", 0)  # aligned 16-row blocks
    ran.clear()
    moe_experts_triton(x, gate_up, down, weights, ids, path="gemv")
    assert ran == ["dot", "dot"]
    with pytest.raises(ValueError, match="alignment-free"):
        moe_experts_triton(x, gate_up, down, weights, ids, path=_gemv("int8-g64", 1, 16, 1))
    monkeypatch.setattr("ninfer.kernels.moe.gemm.DIRECT_MAX_PAIRS", 64)
    with pytest.raises(ValueError, match="int4 codes as 32-bit words"):
        moe_experts_triton(x, gate_up, down, weights, ids, path=_gemv("int8-g64", 1, 16, 1, "gemv-w32"))
    with pytest.raises(ValueError, match="path must be"):
        moe_experts_triton(x, gate_up, down, weights, ids, path="fast")
    # path=None follows NINFER_MOE_PATH as it is at the call; a bad value names the variable
    monkeypatch.setenv("NINFER_MOE_PATH", "gemv")
    ran.clear()
    moe_experts_triton(x, gate_up, down, weights, ids)
    assert ran == ["gemv", "gemv"]
    monkeypatch.setenv("NINFER_MOE_PATH", "fast")
    with pytest.raises(ValueError, match="NINFER_MOE_PATH must be one of auto, dot, gemv, mma, got 'fast'"):
        moe_experts_triton(x, gate_up, down, weights, ids)


def test_candidates() -> None:
    """35B shapes: valid for every format, one token's pairs one per pass, splits fill an H200."""
    for fmt in SHAPES:
        for pairs in (8, 16, 64):
            for n_out, k in ((512, 2048), (2048, 512)):
                cands = expert_gemv_candidates(fmt, pairs, n_out, k, 132)
                assert len(set(cands)) == len(cands) >= 5 and all(c.kind.startswith("gemv") for c in cands)
                assert any(c.kind == "gemv-w32" for c in cands) == fmt.startswith("int4")
                for c in cands:
                    assert c.block_m == (1 if pairs <= 8 else 2) and c.num_stages <= 3
                    assert c.block_k % quant_gemm_tune.GROUPS.get(fmt, 1) == 0
                    tiles = pairs * -(-n_out // c.block_n)
                    assert c.split_k == 1 or (tiles < 4 * 132 and c.split_k <= -(-k // c.block_k))
    assert any(c.split_k > 1 for c in expert_gemv_candidates("int4-g64", 8, 512, 2048, 132))


def _rows(pairs: int, direct: bool = True) -> ExpertRows:
    ids = torch.arange(pairs).reshape(-1, 1) % E
    return expert_rows(ids, E, MAX_PAIRS if direct else 0, 16)


@pytest.fixture
def tuner() -> Iterator[TunerState]:
    """A fresh tuner state with tuning on, the process's for the test."""
    with use_tuner(TunerState(enabled=True)) as state:
        yield state


def test_selection_keeps_the_faster_path_per_key(monkeypatch: pytest.MonkeyPatch, tuner: TunerState) -> None:
    """First tunable call of a key times GROUPED_DOT and the GEMV candidates from graph replays and keeps
    the fastest; later calls, and calls under capture, reuse it; untuned keys under capture, calls with
    tuning off, aligned rows and > MAX_PAIRS pairs take the dot without timing anything."""
    monkeypatch.setattr(tuning, "on_gpu", lambda device: True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    fast_gemv: dict[str, GemmConfig | None] = {"cfg": None}  # the GEMV candidate made faster than the dot
    launched: list[GemmConfig] = []

    def graph_ms(fn, cold: bool | None = None) -> float:
        assert not capturing[0] and cold  # the expert tuner times its candidates L2-cold (NINFER_TUNE_L2_COLD)
        fn()
        cfg = launched[-1]
        if cfg == GROUPED_DOT:
            return 1.0
        return 0.5 if cfg == fast_gemv["cfg"] else 2.0

    monkeypatch.setattr(quant_gemm_timing, "graph_ms", graph_ms)
    a = torch.zeros(1, 64)

    def choose(rows, swiglu: bool, n_out: int = 32, dtype: torch.dtype = torch.float32) -> GemmConfig:
        return choose_config("int4-g64", a.to(dtype), rows, n_out, 64, swiglu, launched.append)

    rows8 = _rows(8)
    fast = fast_gemv["cfg"] = expert_gemv_candidates("int4-g64", 8, 32, 64, quant_gemm_tune.sm_count(a.device))[2]
    assert choose(rows8, swiglu=True) == fast
    n_cands = len(launched)
    assert launched[0] == GROUPED_DOT and n_cands == 1 + len(expert_gemv_candidates("int4-g64", 8, 32, 64, 4))
    fast_gemv["cfg"] = None
    assert choose(rows8, swiglu=False) == GROUPED_DOT  # down key: every GEMV slower
    assert len(launched) == 2 * n_cands
    launched.clear()
    assert choose(_rows(7), swiglu=True) == fast and not launched  # same bucket: no re-timing
    capturing[0] = True
    assert choose(rows8, swiglu=True) == fast  # capture: what was chosen
    assert choose(_rows(16), swiglu=True) == GROUPED_DOT  # capture, untuned key: the dot
    assert choose(rows8, swiglu=True, dtype=torch.float16) == GROUPED_DOT
    assert not launched
    capturing[0] = False
    many = expert_rows(torch.arange(MAX_PAIRS + 1).reshape(-1, 1) % E, E, 2 * MAX_PAIRS, 16)
    assert many.direct and choose(many, swiglu=True) == GROUPED_DOT
    assert choose(_rows(16, direct=False), swiglu=True) == GROUPED_DOT
    tuner.enabled = False
    assert choose(_rows(16), swiglu=True) == GROUPED_DOT and not launched
    assert set(tuner.chosen("moe_gemv").values()) == {fast, GROUPED_DOT}
    timings = tuner.timings("moe_gemv")
    assert len(timings) == 2 and all(len(t) == n_cands and t[GROUPED_DOT] == 1.0 for t in timings.values())


def test_aligned_verification_rows_choose_between_the_dot_and_the_register_decode(monkeypatch: pytest.MonkeyPatch,
                                                                                   tuner: TunerState) -> None:
    """Aligned rows in blocks of 16 of up to ALIGNED_MAX_PAIRS pairs (a verification of several lanes), bf16 / fp16:
    the dot and the register decode's candidates are timed (no GEMV: it needs decode rows); beyond that, in blocks
    of 64, or with fp32 activations, the dot without timing."""
    from ninfer.kernels.moe.mma_configs import expert_mma_candidates
    from ninfer.kernels.moe.quant_mma import ALIGNED_MAX_PAIRS

    monkeypatch.setattr(tuning, "on_gpu", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    launched: list[GemmConfig] = []
    mma = expert_mma_candidates("int4-g64", 80, 32, 256, quant_gemm_tune.sm_count(torch.device("cpu")))
    monkeypatch.setattr(quant_gemm_timing, "graph_ms",
                        lambda fn, cold=None: (fn(), 0.5 if launched[-1] == mma[1] else 1.0)[1])
    a = torch.zeros(1, 256, dtype=torch.float16)

    def choose(rows: ExpertRows, dtype: torch.dtype = torch.float16) -> GemmConfig:
        return choose_config("int4-g64", a.to(dtype), rows, 32, 256, True, launched.append)

    aligned = _rows(80, direct=False)
    assert not aligned.direct and aligned.block_m == 16
    assert choose(aligned) == mma[1] and launched == [GROUPED_DOT, *mma]
    launched.clear()
    assert choose(aligned, torch.float32) == GROUPED_DOT
    assert choose(_rows(ALIGNED_MAX_PAIRS + 1, direct=False)) == GROUPED_DOT
    ids = torch.arange(80).reshape(-1, 1) % E
    assert choose(expert_rows(ids, E, 0, 64)) == GROUPED_DOT and not launched


def test_auto_path_runs_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch, tuner: TunerState) -> None:
    """launch_quant_experts with path=None: the selection's candidates really launch (fake timings make
    the prefetch GEMV the fastest for gate/up, the dot for down) and the chosen kernels give the output."""
    monkeypatch.setattr(tuner, "tunable", lambda device: True)
    ran: list[tuple[GemmConfig, bool]] = []
    dot, gemv = moe_quant_gemm._launch_dot, moe_quant_gemm.launch_expert_gemv

    def spy_dot(*a: object, **k: object) -> None:
        ran.append((GROUPED_DOT, k["swiglu"]))
        dot(*a, **k)

    def spy_gemv(*a: object, cfg: GemmConfig, **k: object) -> None:
        ran.append((cfg, k["swiglu"]))
        gemv(*a, cfg=cfg, **k)

    def graph_ms(fn, cold: bool | None = None) -> float:
        fn()
        cfg, swiglu = ran[-1]
        return 1.0 if cfg == GROUPED_DOT else 0.5 if swiglu and cfg.kind == "gemv-prefetch" else 3.0

    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", spy_dot)
    monkeypatch.setattr(moe_quant_gemm, "launch_expert_gemv", spy_gemv)
    monkeypatch.setattr(quant_gemm_timing, "graph_ms", graph_ms)
    fmt = "nvfp4"
    h, i = SHAPES[fmt]
    gate_up, down = expert_stacks(fmt, E, h, i, seed=4)
    weights, ids = expert_routing(2, E, K)
    x = torch.randn(2, h)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    picked = {key[5]: cfg for key, cfg in tuner.chosen("moe_gemv").items()}  # by swiglu
    assert len(picked) == 2 and picked[True].kind == "gemv-prefetch" and picked[False] == GROUPED_DOT
    assert ran[-1] == (GROUPED_DOT, False) and (picked[True], True) in ran  # the real launches after timing
    ref = moe_experts_reference(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    assert (got - ref).norm() / ref.norm() < TOL[torch.float32]
    ran.clear()
    assert torch.equal(moe_experts_triton(x, gate_up, down, weights, ids), got)
    assert ran == [(picked[True], True), (GROUPED_DOT, False)]  # tuned once per key
