"""MoE router, alignment and grouped expert GEMMs (CPU interpreter) against the PyTorch references."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe import align as moe_align
from ninfer.kernels.moe import gemm as moe_gemm
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import (
    moe_experts_reference,
    route_topk_reference,
    route_topk_triton,
)
from ninfer.kernels.moe.align import align_pairs
from ninfer.kernels.moe.gemm import moe_experts_triton

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")

E, K, H, I = 8, 2, 64, 32
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers allocate their outputs: fresh float allocations are NaN and int ones -7, so that
    anything read before it is written shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _experts(dtype: torch.dtype, e: int = E, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    down = (torch.randn(e, H, I, generator=g) * I ** -0.5).to(dtype)
    return gate_up, down


def _routing(n: int, dtype: torch.dtype, e: int = E, k: int = K, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing that leaves experts 0 and 5 without tokens and sends most tokens to expert 3."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    logits[:, [0, 5]] = -30.0
    logits[: max(1, 2 * n // 3), 3] = 30.0
    return route_topk_reference(logits.to(dtype), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 37])
def test_moe_experts_matches_reference(dtype: torch.dtype, n: int) -> None:
    gate_up, down = _experts(dtype)
    weights, ids = _routing(n, dtype)
    x = torch.randn(n, H).to(dtype)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    ref = moe_experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    assert got.shape == (n, H) and got.dtype == dtype and torch.isfinite(got).all()
    assert _err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("path,n", [("aligned", 3), ("direct", 37), ("multi_program_tiled", 37)])
def test_moe_experts_other_paths(monkeypatch: pytest.MonkeyPatch, path: str, n: int) -> None:
    """Alignment at decode sizes, the alignment-free path with 74 pairs, and the three-launch
    alignment (small chunks) with 64-row blocks, at a small shape."""
    monkeypatch.setattr(moe_gemm, "DIRECT_MAX_PAIRS", {"aligned": 0, "direct": 128}.get(path, 64))
    if path == "multi_program_tiled":
        monkeypatch.setattr(moe_align, "CHUNK", 16)
        monkeypatch.setattr(moe_gemm, "SKINNY_ROWS", 0)
    gate_up, down = _experts(torch.float32, seed=2)
    weights, ids = _routing(n, torch.float32, seed=3)
    x = torch.randn(n, H)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    assert _err(got, moe_experts_reference(x, gate_up, down, weights, ids)) < TOL[torch.float32]


@pytest.mark.parametrize("n", [5, 12, 40])  # 9, 23 (two 16-row tiles without alignment), 79 pairs on expert 6
def test_repeated_experts_and_int32_ids(n: int) -> None:
    """All tokens on one expert, and a token listing the same expert in both slots (hand-made ids)."""
    gate_up, down = _experts(torch.float32, seed=4)
    ids = torch.full((n, K), 6, dtype=torch.int32)
    ids[0, 1] = 2
    weights = torch.rand(n, K)
    x = torch.randn(n, H)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    ref = moe_experts_reference(x, gate_up, down, weights, ids.long())
    assert _err(got, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_shared_expert_in_the_combine(dtype: torch.dtype) -> None:
    """The combine adds ``sigmoid(logit) * shared``: the logit a strided column (the router's last); a shared
    output of the wrong shape is refused."""
    n = 5
    gate_up, down = _experts(dtype, seed=7)
    weights, ids = _routing(n, dtype, seed=8)
    x = torch.randn(n, H).to(dtype)
    shared_out = torch.randn(n, H).to(dtype)
    logit = (torch.randn(n, E + 1) * 3).to(dtype)[:, E:]
    got = moe_experts_triton(x, gate_up, down, weights, ids, shared=(shared_out, logit))
    routed = moe_experts_triton(x, gate_up, down, weights, ids)
    unfused = routed + torch.sigmoid(logit) * shared_out
    assert got.shape == (n, H) and torch.isfinite(got).all()
    torch.testing.assert_close(got, unfused, atol=TOL[dtype], rtol=TOL[dtype])
    ref = moe_experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids,
                                (shared_out.float(), logit.float()))
    assert _err(got, ref) < TOL[dtype]
    with pytest.raises(ValueError, match="shared expert output"):
        moe_experts_triton(x, gate_up, down, weights, ids, shared=(shared_out[:, :H // 2], logit))


def test_mixed_weight_dtype() -> None:
    """fp16 experts under fp32 activations are converted in registers."""
    n = 3
    gate_up, down = _experts(torch.float16, seed=5)
    weights, ids = _routing(n, torch.float32)
    x = torch.randn(n, H)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    assert _err(got, moe_experts_reference(x, gate_up.float(), down.float(), weights, ids)) < 1e-5


@pytest.mark.parametrize("chunk", [moe_align.CHUNK, 8])
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_layout(monkeypatch: pytest.MonkeyPatch, chunk: int, block_m: int) -> None:
    monkeypatch.setattr(moe_align, "CHUNK", chunk)
    n = 23
    _, ids = _routing(n, torch.float32, seed=6)
    sorted_pairs, block_experts, post = align_pairs(ids, E, block_m)
    counts = torch.bincount(ids.flatten(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    assert int(post[0]) == total and sorted_pairs.numel() >= total
    flat = ids.flatten()
    for e in range(E):
        group = sorted_pairs[starts[e]: starts[e] + padded[e]]
        expected = torch.nonzero(flat == e).flatten().to(torch.int32)  # stable: ascending pair order
        assert torch.equal(group[: counts[e]], expected)
        assert (group[counts[e]:] == n * K).all()  # sentinel padding
        assert (block_experts[starts[e] // block_m: (starts[e] + padded[e]) // block_m] == e).all()
    assert (block_experts[total // block_m:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("e,k", [(8, 2), (256, 8), (20, 3)])
def test_router_matches_reference(dtype: torch.dtype, e: int, k: int) -> None:
    logits = (torch.randn(37, e) * 2).to(dtype)
    weights, ids = route_topk_triton(logits, k)
    ref_w, ref_ids = route_topk_reference(logits, k)
    # fp16 logits can tie exactly; ties are compared as sets of probabilities below.
    probs = logits.float().softmax(-1)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights.float(), ref_w.float(), rtol=TOL[dtype], atol=1e-6)


def test_router_ties_prefer_lower_ids() -> None:
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 1.0
    logits[1, :] = 0.5
    weights, ids = route_topk_triton(logits, 2)
    assert ids.tolist() == [[3, 9], [0, 1]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
