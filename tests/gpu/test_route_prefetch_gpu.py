"""``NINFER_ROUTE_PREFETCH=1`` on the GPU: the MoE routing that asks the L2 for the chosen experts' gate/up bytes
(several programs per token, ``prefetch.global.L2`` per line) stores the same weights and ids, bit for bit, as
the plain launch, eagerly and replayed from a CUDA graph with new logits, at 1, 2 and 4 tokens (prefetching) and 8
(not), over a 35B-A3B-sized int4 stack."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import repeated_expert_stack

from ninfer.kernels.moe.routing import route_topk_reference, route_topk_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, TOP_K, TWO_I, H = 256, 8, 1024, 2048


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_prefetching_routes_as_the_plain_launch(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = repeated_expert_stack(E, TWO_I, H, "cuda")
    logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "0")
    plain = route_topk_triton(logits, TOP_K, stack)
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "1")
    early = route_topk_triton(logits, TOP_K, stack)
    assert torch.equal(plain[0], early[0]) and torch.equal(plain[1], early[1])
    _, ref_ids = route_topk_reference(logits, TOP_K)
    probs = logits.float().softmax(-1)  # bf16 logits tie: compare the chosen probabilities
    assert torch.equal(probs.gather(1, early[1]).sort(-1).values, probs.gather(1, ref_ids).sort(-1).values)
    static = logits.clone()
    route_topk_triton(static, TOP_K, stack)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk_triton(static, TOP_K, stack)
    for seed in range(2):
        static.copy_(torch.randn(n, E, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "0")
        want = route_topk_triton(static, TOP_K, stack)
        monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "1")
        assert torch.equal(weights, want[0]) and torch.equal(ids, want[1])
