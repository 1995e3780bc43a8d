"""Decode steps left in flight on the GPU (``ninfer.runtime.run_ahead``): replayed from CUDA graphs, inputs from
pinned memory, tokens copied out behind an event. Greedy and seeded tokens, stops and a prompt that arrives
mid-decode are those of the engine that waits for each step's tokens."""
from __future__ import annotations

import pytest
import torch

import ninfer
from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_dense, make_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request, tmp_path_factory) -> TinyCheckpoint:
    if request.param == "dense":
        return make_dense(tmp_path_factory.mktemp("adense"), seed=1, overrides=REAL_HEADS)
    return make_moe(tmp_path_factory.mktemp("amoe"), expert_layout="fused", seed=2,
                    overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})


def _run(ckpt: TinyCheckpoint, ahead: bool, graphs: bool) -> tuple[list, int]:
    # fp32: steps that run ahead may batch differently (a request's row stops one step earlier), and bf16 could
    # round a near tie the other way at another batch size
    llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.float32, progress=False, max_concurrency=4,
                      prefill_chunk=32, cuda_graphs=graphs, decode_ahead=ahead)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 448, (n,), generator=g).tolist() for n in (7, 40, 3, 25)]
    params = [llm.sampling_params(greedy=True), llm.sampling_params(temperature=0.9, seed=3),
              llm.sampling_params(temperature=0.7, seed=4, repetition_penalty=1.2), llm.sampling_params(greedy=True)]
    reqs = [llm._request(p, n, sp, stop_token_ids=stop)
            for p, n, sp, stop in zip(prompts, (24, 30, 9, 20), params, (None, None, None, [5, 77, 300]))]
    for r in reqs[:3]:
        llm.engine.add_request(r)
    in_flight = 0
    for step in range(400):
        if step == 8:
            llm.engine.add_request(reqs[3])
        if step > 8 and not llm.engine.has_work:
            break
        llm.engine.step()
        in_flight += llm.engine.ahead is not None
    assert llm.engine.is_idle()
    return [(r.output_ids, r.finish_reason) for r in reqs], in_flight


@pytest.mark.parametrize("graphs", [True, False])
def test_tokens_match_the_engine_that_waits(ckpt: TinyCheckpoint, graphs: bool) -> None:
    waits, none = _run(ckpt, False, graphs)
    ahead, in_flight = _run(ckpt, True, graphs)
    assert none == 0 and in_flight > 10
    assert ahead == waits
