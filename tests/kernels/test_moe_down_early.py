"""``NINFER_MOE_DOWN_EARLY=1``: the MoE down projection launched to request its expert ids and weights before it
waits for the gate/up (:func:`ninfer.kernels.pdl.early_pdl`), in the Triton interpreter.

On CPU there is no programmatic dependent launch and no inline PTX, so this checks what the interpreter can: the
GEMV's and the register decode's early variants (ids read before the wait, the wait after the first trip's codes)
give the same output as the plain launch to the bit, in every format of the GEMV and both epilogues; only the down
launch is early; the tuner's timed launches never are. The GPU test (``tests/gpu/test_moe_down_early_gpu.py``) runs
the real launches, the L2 hints and CUDA graphs.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import expert_routing, expert_stacks, poisoned_outputs  # noqa: F401  (a fixture)

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import quant_gemm as moe_quant_gemm
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.mma_configs import EXPERT_MMA_KIND
from ninfer.kernels.quant_gemm import timing as quant_gemm_timing
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.kernels.tuning import TunerState, use_tuner

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K = 8, 2
GEMV = {  # format: (H, I, K step)
    "int4-g64": (192, 64, 64), "int8-g64": (192, 64, 64), "nvfp4": (176, 48, 64), "fp8-b128": (192, 96, 128),
}
MMA = GemmConfig(8, 32, 128, 2, 2, 2, EXPERT_MMA_KIND)  # 2 warps, 2 chunks a trip, split 2, prefetch


def _spy_early(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Record the ``early`` argument of each launch of ``moe.quant_gemm``'s ``name``."""
    seen: list[bool] = []
    real = getattr(moe_quant_gemm, name)

    def spy(*args: object, early: bool = False, **kwargs: object) -> None:
        seen.append(early)
        real(*args, early=early, **kwargs)

    monkeypatch.setattr(moe_quant_gemm, name, spy)
    return seen


def _both(monkeypatch: pytest.MonkeyPatch, fmt: str, h: int, i: int, n: int, path: GemmConfig | str,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, down = expert_stacks(fmt, E, h, i, seed=n)
    weights, ids = expert_routing(n, E, K, seed=n + 1)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(n + 2)).to(dtype)
    out = []
    for early in ("0", "1"):
        monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", early)
        out.append(moe_experts_triton(x, gate_up, down, weights.to(dtype), ids, path=path))
    return out[0], out[1]


@pytest.mark.parametrize("fmt", list(GEMV))
def test_the_early_gemv_equals_the_plain_one(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    seen = _spy_early(monkeypatch, "launch_expert_gemv")
    h, i, bk = GEMV[fmt]
    for n, split in ((1, 1), (3, 2)):
        seen.clear()
        plain, early = _both(monkeypatch, fmt, h, i, n, GemmConfig(1, 16, bk, split, 4, 1, "gemv"))
        assert torch.equal(plain, early)
        assert seen == [False, False, False, True]  # gate/up and down, then with the switch: only the down early


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_early_register_decode_equals_the_plain_one(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    seen = _spy_early(monkeypatch, "launch_expert_mma")
    plain, early = _both(monkeypatch, "int4-g64", 256, 128, 2, MMA, dtype)
    assert torch.equal(plain, early)
    assert seen == [False, False, False, True]


def test_the_tuner_times_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch on and the expert GEMMs tuned (fake timings: the GEMV fastest): every timed launch is plain, the
    real down launch early."""
    seen = _spy_early(monkeypatch, "launch_expert_gemv")
    dots: list[int] = []
    real_dot = moe_quant_gemm._launch_dot
    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", lambda *a, **k: (dots.append(len(seen)), real_dot(*a, **k)))

    def graph_ms(fn, cold: bool | None = None) -> float:
        before = len(dots)
        fn()
        return 9.0 if len(dots) > before else 1.0

    monkeypatch.setattr(quant_gemm_timing, "graph_ms", graph_ms)
    monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", "1")
    gate_up, down = expert_stacks("int8-g64", E, 192, 64, seed=5)
    weights, ids = expert_routing(1, E, K)
    with use_tuner(TunerState(enabled=True)) as state:
        monkeypatch.setattr(state, "tunable", lambda device: True)
        moe_experts_triton(torch.randn(1, 192), gate_up, down, weights, ids, path="auto")
        chosen = state.chosen("moe_gemv")
    assert len(chosen) == 2 and all(cfg.kind.startswith("gemv") for cfg in chosen.values())
    assert len(seen) > 2 and seen[-1] is True and not any(seen[:-1]), seen
