"""The expert register decode (:mod:`ninfer.kernels.moe.quant_mma`) in the Triton interpreter.

int4 expert stacks (g64 and g128) against dequantize + ``moe_experts_reference`` in fp32, fp32 and fp16
activations, both epilogues (gate/up SwiGLU, down times the routing weight), split-K with the fused and with the
separate reduction, prefetch on and off, ragged tile groups, and experts holding more than eight pairs (a
second block of eight, served by its own program), and rows aligned in blocks of 16 past the alignment-free limit
(each program half a block). Outputs and scratch are NaN-poisoned. The interpreter runs
the kernel's Triton gathers, not its PTX: the GPU tests check that (``tests/gpu/test_moe_quant_mma.py``).
"""
from __future__ import annotations

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

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import moe_experts_reference
from ninfer.kernels.moe import quant_gemm as moe_quant_gemm
from ninfer.kernels.moe.align import expert_rows
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.mma_configs import (
    EXPERT_KSPLIT_KIND,
    EXPERT_MMA_KIND,
    expert_ksplit_candidates,
    expert_mma_candidates,
    expert_mma_fits,
)
from ninfer.kernels.moe.quant_mma import launch_expert_mma
from ninfer.kernels.quant_gemm.gemv import reduce_kernel_for_splits
from ninfer.kernels.quant_gemm.tune import GemmConfig

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K = 8, 2


def _cfg(warps: int, unroll: int, split: int, prefetch: bool) -> GemmConfig:
    return GemmConfig(8, 16 * warps, 64 * unroll, split, warps, 2 if prefetch else 1, EXPERT_MMA_KIND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt,h,i", [("int4-g64", 256, 128), ("int4-g128", 256, 128)])
def test_expert_mma_matches_reference(fmt: str, h: int, i: int, dtype: torch.dtype) -> None:
    """1 token (two pairs), 5 tokens, 13 tokens (expert 3 holds more than eight pairs: two blocks)."""
    for n, cfg in [(1, _cfg(4, 2, 1, False)), (5, _cfg(2, 2, 2, True)), (13, _cfg(4, 2, 2, False))]:
        check_quant_experts(fmt, h, i, dtype, n, cfg, seed=n)


def _ksplit(warps: int, unroll: int, prefetch: bool) -> GemmConfig:
    return GemmConfig(8, 16, 64 * unroll, 1, warps, 2 if prefetch else 1, EXPERT_KSPLIT_KIND)


@pytest.mark.parametrize("fmt,h,i,unroll", [("int4-g64", 256, 128, 1), ("int4-g128", 1024, 512, 2)])
def test_warps_splitting_k(fmt: str, h: int, i: int, unroll: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tile a program, K split between its warps (their sums exchanged, warp 0 storing): 1, 5 and 13 tokens
    (two blocks of one expert), the next trip's codes requested or not; the configs ``NINFER_FRAG_KSPLIT=1`` adds
    and a K without equal shares refused."""
    for n, cfg in [(1, _ksplit(2, unroll, False)), (5, _ksplit(2, unroll, True)), (13, _ksplit(2, unroll, True))]:
        check_quant_experts(fmt, h, i, torch.float16, n, cfg, seed=30 + n)
    if unroll == 2:
        check_quant_experts(fmt, h, i, torch.float16, 5, _ksplit(4, 2, True), seed=40)
    monkeypatch.setenv("NINFER_FRAG_KSPLIT", "1")
    ksplit = expert_ksplit_candidates("int4-g64", 512, 2048)
    assert ksplit and ksplit == expert_mma_candidates("int4-g64", 8, 512, 2048, sms=132)[-len(ksplit):]
    with pytest.raises(ValueError, match="equal shares"):
        check_quant_experts("int4-g64", 256, 128, torch.float16, 1, _ksplit(4, 2, False))


def test_ragged_tiles_one_chunk_trips_and_separate_reduction() -> None:
    """12 gate/up tiles over 4-warp programs (the last program's warps past the end), K = 192 (trips of one
    chunk), split-K summed by the last program (split after split for all accumulators at once, the default, and
    with ``NINFER_SPLIT_SUM=each`` accumulator after accumulator) and by the reduce kernel instead."""
    cfg = _cfg(4, 1, 3, True)
    for mode, seed in (("across", 4), ("each", 6)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NINFER_SPLIT_SUM", mode)
            check_quant_experts("int4-g64", 256, 192, torch.float32, 6, cfg, seed=seed)
    with reduce_kernel_for_splits():
        check_quant_experts("int4-g64", 256, 192, torch.float32, 6, cfg, seed=5)


def test_repeated_slot_and_experts_without_tokens() -> None:
    """A token listing expert 6 in both slots, nine pairs on expert 6; NaN in experts without tokens never
    reaches the output."""
    ids = torch.full((5, K), 6, dtype=torch.int32)
    ids[0, 1] = 2
    check_quant_experts("int4-g64", 256, 128, torch.float32, 5, _cfg(2, 2, 2, False), seed=3, ids=ids)
    stacks = expert_stacks("int4-g64", E, 256, 128, seed=9)
    weights, ids = expert_routing(4, E, K)
    poisoned = nan_experts(stacks, [0, 5])
    x = torch.randn(4, 256)
    cfg = _cfg(4, 2, 2, True)
    assert torch.equal(moe_experts_triton(x, *poisoned, weights, ids, path=cfg),
                       moe_experts_triton(x, *stacks, weights, ids, path=cfg))


def test_mma_path_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    """path="mma" runs the register decode on int4 stacks at decode rows, the dot on other formats and on aligned
    rows; so does ``NINFER_MOE_PATH=mma``."""
    ran: list[str] = []
    dot, mma = moe_quant_gemm._launch_dot, moe_quant_gemm.launch_expert_mma
    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", lambda *a, **k: (ran.append("dot"), dot(*a, **k)))
    monkeypatch.setattr(moe_quant_gemm, "launch_expert_mma", lambda *a, **k: (ran.append("mma"), mma(*a, **k)))
    weights, ids = expert_routing(3, E, K)
    for fmt, want in (("int4-g64", "mma"), ("int8-g64", "dot")):
        stacks = expert_stacks(fmt, E, 256, 128)
        x = torch.randn(3, 256)
        ran.clear()
        got = moe_experts_triton(x, *stacks, weights, ids, path="mma")
        ref = moe_experts_reference(x, *(w.dequantize() for w in stacks), weights, ids)
        assert ran == [want, want] and (got - ref).norm() / ref.norm() < TOL[torch.float32], fmt
    monkeypatch.setenv("NINFER_MOE_PATH", "mma")
    ran.clear()
    moe_experts_triton(x, *expert_stacks("int4-g64", E, 256, 128), weights, ids)
    assert ran == ["mma", "mma"]
    monkeypatch.setattr("ninfer.kernels.moe.gemm.DIRECT_MAX_PAIRS", 0)  # aligned 16-row blocks: still served
    ran.clear()
    moe_experts_triton(x, *expert_stacks("int4-g64", E, 256, 128), weights, ids)
    assert ran == ["mma", "mma"]
    monkeypatch.setattr("ninfer.kernels.moe.gemm.block_m_for", lambda pairs, experts: 64)  # 64-row blocks: the dot
    ran.clear()
    moe_experts_triton(x, *expert_stacks("int4-g64", E, 256, 128), weights, ids)
    assert ran == ["dot", "dot"]


def test_fit_candidates_and_errors() -> None:
    assert expert_mma_fits("int4-g64", 512, 2048) and not expert_mma_fits("int8-g64", 512, 2048)
    assert not expert_mma_fits("int4-g64", 520, 2048) and not expert_mma_fits("int4-g128", 512, 2048, unroll=1)
    cands = expert_mma_candidates("int4-g64", 8, 512, 2048, sms=132)
    assert cands and all(c.kind == EXPERT_MMA_KIND and 2048 % c.block_k == 0 for c in cands)
    assert any(c.split_k > 1 for c in cands) and any(c.num_stages > 1 for c in cands)
    gate_up, _ = expert_stacks("int4-g64", E, 256, 128)
    weights, ids = expert_routing(2, E, K)
    x = torch.randn(2, 256)
    dst = torch.empty(4, 128)
    with pytest.raises(ValueError, match="does not fit"):  # outputs not whole 16-row tiles
        launch_expert_mma(expert_rows(ids, E, 64, 16), x, gate_up, dst[:, :120], weights.reshape(-1), a_div=K,
                          swiglu=True, cfg=_cfg(4, 2, 1, False))
    with pytest.raises(ValueError, match="blocks of 16"):  # aligned rows in blocks of 64
        launch_expert_mma(expert_rows(ids, E, 0, 64), x, gate_up, dst, weights.reshape(-1), a_div=K, swiglu=True,
                          cfg=_cfg(4, 2, 1, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_aligned_blocks_of_sixteen(dtype: torch.dtype) -> None:
    """Past the alignment-free limit (40 tokens x 2 slots = 80 pairs over 8 experts: blocks of 16 pairs, most
    experts several blocks, the last of each partly padding): programs serve halves of blocks and skip padding."""
    check_quant_experts("int4-g64", 256, 128, dtype, 40, _cfg(4, 2, 2, True), seed=40)

