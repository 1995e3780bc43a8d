"""MoE router and grouped expert GEMMs on the GPU at the Qwen3.5-35B-A3B shapes vs the fp32 references."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe import gemm as moe_gemm
from ninfer.kernels.moe import (
    moe_experts,
    moe_experts_reference,
    route_topk,
    route_topk_reference,
    route_topk_triton,
)
from ninfer.kernels.moe.align import align_pairs
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.runtime.graphs import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, TOP_K, H, I = 256, 8, 2048, 512
TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}  # relative Frobenius error of the output


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5
    return gate_up, down


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _route(n: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, E, generator=g, device="cuda")
    if skew:  # expert 7 in every token's top k, half the experts never chosen
        logits[:, 7] = 20.0
        logits[:, E // 2:] = -20.0
    return route_topk_reference(logits.to(torch.bfloat16), TOP_K)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# Up to 8 tokens: no alignment launch; 17, 300: 16-row blocks; 1500 * 8 pairs: 64-row blocks, 3-launch alignment.
@pytest.mark.parametrize("n", [1, 2, 3, 8, 17, 300, 1500])
def test_real_shapes(experts: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, n: int) -> None:
    gate_up, down = experts
    weights, ids = _route(n, n)
    x = torch.randn(n, H, device="cuda")
    got = moe_experts_triton(x.to(dtype), gate_up.to(dtype), down.to(dtype), weights.to(dtype), ids)
    ref = moe_experts_reference(x.to(dtype).float(), gate_up.to(dtype).float(), down.to(dtype).float(),
                                weights.float(), ids)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert _err(got, ref) < TOL[dtype], (n, dtype)


@pytest.mark.parametrize("n", [4, 5000])
def test_skewed_routing(experts: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    weights, ids = _route(n, 11, skew=True)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    ref = moe_experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    assert _err(got, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("direct_max", [0, 64])
def test_decode_with_and_without_alignment(experts: tuple[torch.Tensor, torch.Tensor], direct_max: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_gemm, "DIRECT_MAX_PAIRS", direct_max)
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    for n in (1, 8):
        weights, ids = _route(n, 20 + n)
        x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
        got = moe_experts_triton(x, gate_up, down, weights, ids)
        ref = moe_experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
        assert _err(got, ref) < TOL[torch.bfloat16], (n, direct_max)


def test_one_expert_for_every_slot(experts: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Hand-made ids: 56 pairs on one expert (four 16-row tiles in one decode program), 8 on another."""
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    ids = torch.full((8, TOP_K), 200, device="cuda", dtype=torch.int64)
    ids[3] = 9
    weights = torch.rand(8, TOP_K, device="cuda").to(torch.bfloat16)
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    ref = moe_experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    assert _err(got, ref) < TOL[torch.bfloat16]


def test_bf16_weights_under_fp32_stacks(experts: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Dequantized stacks may arrive in fp32 while activations are bf16: converted in registers."""
    gate_up, down = experts
    weights, ids = _route(6, 3)
    x = torch.randn(6, H, device="cuda", dtype=torch.bfloat16)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    ref = moe_experts_reference(x.float(), gate_up, down, weights.float(), ids)
    assert _err(got, ref) < TOL[torch.bfloat16]


def test_alignment_at_real_sizes() -> None:
    for n, block_m in ((8, 16), (8192, 64)):
        _, ids = _route(n, 5)
        sorted_pairs, block_experts, post = align_pairs(ids, E, block_m)
        counts = torch.bincount(ids.flatten(), minlength=E)
        padded = (counts + block_m - 1) // block_m * block_m
        assert int(post[0]) == int(padded.sum())
        real = sorted_pairs[: int(post[0])]
        assert torch.equal(torch.sort(real[real < n * TOP_K]).values,
                           torch.arange(n * TOP_K, device="cuda", dtype=torch.int32))
        starts = torch.cumsum(padded, 0) - padded
        flat = ids.flatten()
        for e in (0, 7, E - 1):
            group = sorted_pairs[starts[e]: starts[e] + counts[e]].long()
            assert (flat[group] == e).all() and (group.diff() > 0).all()
        assert (block_experts[int(post[0]) // block_m:] == -1).all()


@pytest.mark.parametrize("e,k", [(8, 2), (16, 4), (64, 8), (256, 8)])
@pytest.mark.parametrize("n", [513, 1024, 4097])
def test_alignment_over_several_chunks_matches_a_stable_sort(e: int, k: int, n: int) -> None:
    """Past one program's pairs (``align.CHUNK``) the plan takes three launches; with few experts each count
    is held by several warps (the tiny test models' 8 experts), which once let a warp read a count that
    another had already replaced by its prefix."""
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.randint(0, e, (n, k), generator=g, device="cuda", dtype=torch.int32)
        for block_m in (16, 64):
            sorted_pairs, block_experts, post = align_pairs(ids, e, block_m)
            flat = ids.flatten().long()
            counts = torch.bincount(flat, minlength=e)
            padded = (counts + block_m - 1) // block_m * block_m
            total = int(padded.sum())
            assert int(post[0]) == total
            want = torch.full((total,), n * k, dtype=torch.int32, device="cuda")
            starts = torch.cumsum(padded, 0) - padded
            order = torch.sort(flat, stable=True).indices.to(torch.int32)
            ends = torch.cumsum(counts, 0)
            for x in range(e):
                want[starts[x]: starts[x] + counts[x]] = order[ends[x] - counts[x]: ends[x]]
            assert torch.equal(sorted_pairs[:total], want)
            owner = torch.repeat_interleave(torch.arange(e, device="cuda", dtype=torch.int32), padded // block_m)
            assert torch.equal(block_experts[: total // block_m], owner)
            assert (block_experts[total // block_m:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e,k", [(256, 8), (512, 10)])
def test_router(dtype: torch.dtype, e: int, k: int) -> None:
    logits = (torch.randn(4096, e, device="cuda") * 2).to(dtype)
    weights, ids = route_topk_triton(logits, k)
    ref_w, ref_ids = route_topk_reference(logits, k)
    probs = logits.float().softmax(-1)
    # bf16 logits tie often among 256 experts; tied experts may swap, their probabilities may not.
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert torch.allclose(weights.float(), ref_w.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    untied = (probs.topk(k + 1, dim=-1).values.diff(dim=1) != 0).all(1)  # no tie up to the (k+1)-th
    assert torch.equal(ids[untied], ref_ids[untied])


def test_dispatchers_pick_triton(experts: tuple[torch.Tensor, torch.Tensor]) -> None:
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    x = torch.randn(5, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(5, E, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(logits, TOP_K)
    assert torch.equal(weights, route_topk_triton(logits, TOP_K)[0])
    assert torch.equal(moe_experts(x, gate_up, down, weights, ids), moe_experts_triton(x, gate_up, down, weights, ids))


def test_deterministic_and_graph_replay(experts: tuple[torch.Tensor, torch.Tensor]) -> None:
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    n = 4
    logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        weights, ids = route_topk(logits, TOP_K)
        return moe_experts(x, gate_up, down, weights, ids)

    first = step()  # compiles and tunes outside the graph
    assert torch.equal(first, step())
    graph, out = capture(step)
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


def test_block_m_choice() -> None:
    assert moe_gemm.block_m_for(8 * TOP_K, E) == 16
    assert moe_gemm.block_m_for(8192 * TOP_K, E) == 64


def test_stacked_router_and_shared_gate_match_separate_projections() -> None:
    """On CUDA the MoE block runs the router and the shared expert's gate as one GEMM over their stacked
    rows (``SparseMoeBlock.router``): the same logits as the two projections over the parts' rows."""
    from ninfer.config import parse_config
    from ninfer.models.moe import SparseMoeBlock
    from tiny_checkpoints import MOE_KWARGS, text_config_kwargs

    config = parse_config({"model_type": "qwen3_5_moe_text", **text_config_kwargs(), **MOE_KWARGS,
                           "num_experts": 256, "hidden_size": 2048})
    block = SparseMoeBlock(config).to("cuda", torch.bfloat16)
    torch.manual_seed(5)
    block.router.weight.data.normal_(0, 0.02)
    gate, shared_gate = block.router.weight.split([256, 1])
    for rows in (1, 8, 300):
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        router, shared = block._router_logits(x)
        assert router.shape == (rows, 256) and shared.shape == (rows, 1)
        torch.testing.assert_close(router.float(), (x @ gate.T).float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(shared.float(), (x @ shared_gate.T).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n", [1, 8, 300])
def test_gated_shared_expert_in_the_combine(experts: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
    """The combine's ``sigmoid(logit) * shared`` in fp32 beside the routed sum, rounded once: against the same math
    in fp32 on the unfused routed output (which was rounded to bf16 once more) and against the three torch ops it
    replaces (each rounding to bf16)."""
    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(torch.randn(n, E, device="cuda", dtype=torch.bfloat16), TOP_K)
    shared = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    logit = (torch.randn(n, E + 1, device="cuda") * 3).to(torch.bfloat16)[:, E:]
    got = moe_experts(x, gate_up, down, weights, ids, shared=(shared, logit))
    routed = moe_experts(x, gate_up, down, weights, ids)
    exact = routed.float() + torch.sigmoid(logit.float()) * shared.float()
    torch.testing.assert_close(got.float(), exact, rtol=8e-3, atol=4e-3)
    torch.testing.assert_close(got, routed + torch.sigmoid(logit) * shared, rtol=1.6e-2, atol=8e-3)


@pytest.mark.parametrize("n", [1, 4, 300])
def test_the_combine_applies_the_next_norm(experts: tuple[torch.Tensor, torch.Tensor], n: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``moe_experts_then_norm`` (``NINFER_MOE_NORM=1``): the combine's normed output and new residual stream against
    ``rms_norm`` of the unfused block's output (the same sum, so the new residual is bit-equal), eagerly and
    replayed from a graph."""
    from ninfer.kernels.moe import moe_experts_then_norm
    from ninfer.kernels.norms import rms_norm

    import ninfer.kernels.moe.dispatch as moe_dispatch

    monkeypatch.setenv("NINFER_MOE_NORM", "1")
    normed_in_combine = []
    triton_experts = moe_dispatch.moe_experts_triton
    monkeypatch.setattr(moe_dispatch, "moe_experts_triton",
                        lambda *a, **k: normed_in_combine.append(k.get("norm") is not None) or triton_experts(*a, **k))

    gate_up, down = (w.to(torch.bfloat16) for w in experts)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(torch.randn(n, E, device="cuda", dtype=torch.bfloat16), TOP_K)
    shared = (torch.randn(n, H, device="cuda", dtype=torch.bfloat16),
              (torch.randn(n, E + 1, device="cuda") * 3).to(torch.bfloat16)[:, E:])
    residual = torch.randn(n, H, device="cuda", dtype=torch.bfloat16) * 4
    w = (torch.randn(H, device="cuda") * 0.3).to(torch.bfloat16)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return moe_experts_then_norm(x, gate_up, down, weights, ids, shared, w, 1e-6, residual)

    ref, ref_res = rms_norm(moe_experts(x, gate_up, down, weights, ids, shared=shared), w, 1e-6, residual)
    normed, new_res = fused()
    assert normed_in_combine[-1]
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref, rtol=8e-3, atol=8e-3)  # the RMS summed in another order
    graph, (g_normed, g_res) = capture(fused)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref, ref_res = rms_norm(moe_experts(x, gate_up, down, weights, ids, shared=shared), w, 1e-6, residual)
    assert torch.equal(g_res, ref_res)
    torch.testing.assert_close(g_normed, ref, rtol=8e-3, atol=8e-3)
