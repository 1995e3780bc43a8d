"""Whole-model checks on the GPU: Triton kernels vs the reference path, engine with and without graphs."""
from __future__ import annotations

import pytest
import torch

import ninfer
from tiny_checkpoints import TinyCheckpoint, make_dense, make_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Few layers and a small hidden size, but the real head geometry the kernels are built for:
# attention head dim 256 with 6 query heads per KV head, DeltaNet dk = dv = 128 with 3 value
# heads per key head (27B's ratios).
REAL_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=256, num_attention_heads=6,
                  num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> TinyCheckpoint:
    return make_dense(tmp_path_factory.mktemp("gdense"), seed=1, overrides=REAL_HEADS)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> TinyCheckpoint:
    return make_moe(tmp_path_factory.mktemp("gmoe"), expert_layout="fused", seed=2,
                    overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 0.15)])
def test_triton_path_matches_reference_path(dense: TinyCheckpoint, monkeypatch, dtype, tol) -> None:
    ids = _prompt(300)
    llm = ninfer.load(dense.path, device="cuda", dtype=dtype, progress=False, cuda_graphs=False)
    triton_lp = llm.score(ids)
    monkeypatch.setenv("NINFER_KERNELS", "reference")
    ref_lp = llm.score(ids)
    assert (triton_lp - ref_lp).abs().max().item() < tol
    # And the fp32 Triton path against transformers itself.
    if dtype == torch.float32:
        with torch.no_grad():
            logits = dense.hf_model(torch.tensor([ids])).logits[0].float()
        hf = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert (triton_lp - hf).abs().max().item() < tol


@pytest.mark.parametrize("ckpt_name", ["dense", "moe"])
def test_engine_graphs_equal_eager_and_batched_equals_single(request, ckpt_name: str) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = [_prompt(n, seed=n) for n in (3, 90, 200, 17)]
    results = {}
    for graphs in (False, True):
        llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.float32, max_concurrency=3, cuda_graphs=graphs,
                          prefill_chunk=64, progress=False)
        reqs = [llm._request(p, 24, llm.sampling_params(greedy=True)) for p in prompts]
        results[graphs] = [c.token_ids for c in llm._run(reqs)]
        single = [llm._run([llm._request(p, 24, llm.sampling_params(greedy=True))])[0].token_ids for p in prompts]
        assert results[graphs] == single
        assert llm.engine.pages.num_free == llm.engine.pages.num_pages
    assert results[False] == results[True]


@pytest.mark.parametrize("kv_dtype, tol", [("fp8", 0.1), ("int8", 0.05)])
def test_quantized_kv_close_to_bf16(dense: TinyCheckpoint, kv_dtype: str, tol: float) -> None:
    ids = _prompt(200, seed=5)
    ref = ninfer.load(dense.path, device="cuda", dtype=torch.bfloat16, progress=False, cuda_graphs=False)
    llm = ninfer.load(dense.path, device="cuda", dtype=torch.bfloat16, kv_dtype=kv_dtype, progress=False,
                      cuda_graphs=False)
    a, b = ref.score(ids), llm.score(ids)
    assert (a - b).abs().mean().item() < tol
