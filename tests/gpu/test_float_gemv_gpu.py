"""The float GEMV (:mod:`ninfer.kernels.float_gemv`) on the GPU at the real shapes in bf16: every candidate against
``F.linear`` in fp32 (outputs NaN-poisoned), split-K through the arrival counters and the reduce kernel, graph
replays equal to eager calls; and the tuned ``float_linear`` equal to the config it chose."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bf16_oracle import assert_same_up_to_rounding
from kernel_testing import assert_close, assert_graph_replays_eager

import ninfer
from ninfer.kernels import float_gemv
from ninfer.kernels.float_gemv import TABLE, float_gemv_candidates, float_linear, launch_float_gemv
from ninfer.kernels.quant_gemm.gemv import reduce_kernel_for_splits
from ninfer.kernels.quant_gemm.tune import sm_count
from ninfer.kernels.tuning import TunerState, use_tuner
from tiny_checkpoints import REAL_HEADS, make_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
SHAPES = {"27b_in_proj_ab": (96, 5120), "35b_router": (257, 2048), "35b_in_proj_ab": (64, 2048)}


def _inputs(m: int, n_out: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n_out, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
    return x, w


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_every_candidate_matches_f_linear(shape: str, m: int) -> None:
    n_out, k = SHAPES[shape]
    x, w = _inputs(m, n_out, k, seed=m)
    ref = F.linear(x.float(), w.float())
    for cfg in float_gemv_candidates(m, n_out, k, sm_count(CUDA)):
        for separate_reduce in (False, True):
            out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
            if separate_reduce:
                with reduce_kernel_for_splits():
                    launch_float_gemv(x, w, out, cfg)
            else:
                launch_float_gemv(x, w, out, cfg)
            assert_close(out.float(), ref, 1e-2)


@pytest.mark.parametrize("m", [1, 4])
def test_graph_replays_equal_eager_calls(m: int) -> None:
    n_out, k = SHAPES["27b_in_proj_ab"]
    x, w = _inputs(m, n_out, k, seed=3)
    out = torch.empty(m, n_out, dtype=torch.bfloat16, device="cuda")
    for cfg in [c for c in float_gemv_candidates(m, n_out, k, sm_count(CUDA)) if c.split_k > 1][:2]:
        def step(cfg=cfg) -> torch.Tensor:
            launch_float_gemv(x, w, out, cfg)
            return out.clone()
        step()
        assert_graph_replays_eager(step, [x], label=cfg)


def test_the_tuned_call_times_both_paths_and_keeps_its_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")  # the runbook's disk cache may hold this key: time it here
    monkeypatch.setenv("NINFER_SHIPPED_TUNING", "0")
    n_out, k = SHAPES["35b_router"]
    x, w = _inputs(4, n_out, k, seed=5)
    with use_tuner(TunerState()) as tuner:
        y = float_linear(x, w)
        (key, cfg), = tuner.chosen(TABLE).items()
        assert len(tuner.timings(TABLE)[key]) == len(float_gemv_candidates(4, n_out, k, sm_count(CUDA)))
        out = torch.empty_like(y)
        launch_float_gemv(x, w, out, cfg)
        assert torch.equal(y, out)
        print(f"router 257 x 2048 at 4 rows: {cfg}")


def test_a_moe_model_decodes_alike_with_the_float_gemv_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 MoE model (router with the shared expert's gate row, a/b gates: its small float projections) with
    the float GEMV in every decode graph and short chunk, against the same model on cuBLAS: the same greedy tokens
    up to bf16 rounding (tests/bf16_oracle.py). First candidates only: cuBLAS, or with cuBLAS dropped the first
    float-GEMV config."""
    ckpt = make_moe(tmp_path, expert_layout="fused", seed=2,
                    overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})
    monkeypatch.setenv("NINFER_AUTOTUNE", "off")
    kw = dict(device="cuda", dtype=torch.bfloat16, progress=False, max_concurrency=2)
    prompts = [torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 9)]
    gen = dict(max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
    base = ninfer.load(ckpt.path, **kw)
    expected = [base.generate(p, **gen) for p in prompts]
    kinds: list[str] = []
    candidates, launch = float_gemv.float_gemv_candidates, float_gemv.launch_float_gemv
    monkeypatch.setattr(float_gemv, "float_gemv_candidates", lambda *a: candidates(*a)[1:])
    monkeypatch.setattr(float_gemv, "launch_float_gemv", lambda x, w, out, cfg: (kinds.append(cfg.kind),
                                                                                 launch(x, w, out, cfg))[1])
    pinned = ninfer.load(ckpt.path, **kw)
    for prompt, ref in zip(prompts, expected):
        assert_same_up_to_rounding(pinned.generate(prompt, **gen), ref, greedy=True)
    assert kinds and set(kinds) == {"float-gemv"}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 8, 16])  # 8+: where the early start applies by default
def test_early_launches_equal_plain_ones(shape: str, m: int) -> None:
    """``early`` (``NINFER_FLOAT_GEMV_EARLY``: launched with PDL, the weights asked of the L2 before the wait): every
    kernel candidate equal to its plain launch to the bit, eagerly and replayed in a CUDA graph after a kernel that
    writes the input (the wait must hold the reads of x back)."""
    n_out, k = SHAPES[shape]
    x, w = _inputs(m, n_out, k, seed=20 + m)
    src = torch.randn_like(x)
    for cfg in float_gemv_candidates(m, n_out, k, sm_count(CUDA))[1:]:
        plain = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        early = plain.clone()
        launch_float_gemv(x, w, plain, cfg)
        launch_float_gemv(x, w, early, cfg, early=True)
        assert torch.equal(plain, early), cfg

        def step(cfg=cfg) -> torch.Tensor:
            x.copy_(src * 2)  # the kernel before, writing what the early launch reads after its wait
            launch_float_gemv(x, w, early, cfg, early=True)
            return early.clone()

        step()
        assert_graph_replays_eager(step, [src], (shape, m, cfg))
        launch_float_gemv(x, w, plain, cfg)
        assert torch.equal(plain, early), cfg
