"""Whole-model checks on the GPU: Triton kernels vs the reference path, engine with and without graphs."""
from __future__ import annotations

import pytest
import torch

import ninfer
from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_dense, make_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()




@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> TinyCheckpoint:
    return make_dense(tmp_path_factory.mktemp("gdense"), seed=1, overrides=REAL_HEADS)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> TinyCheckpoint:
    return make_moe(tmp_path_factory.mktemp("gmoe"), expert_layout="fused", seed=2,
                    overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})


def test_triton_path_matches_reference_path_fp32(dense: TinyCheckpoint, monkeypatch) -> None:
    """fp32 end to end (no TF32 in any Triton product): the two paths and transformers agree closely."""
    ids = _prompt(300)
    llm = ninfer.load(dense.path, device="cuda", dtype=torch.float32, progress=False, cuda_graphs=False)
    triton_lp = llm.score(ids).cpu()
    monkeypatch.setenv("NINFER_KERNELS", "reference")
    vs_reference = (triton_lp - llm.score(ids).cpu()).abs().max().item()
    with torch.no_grad():
        logits = dense.hf_model(torch.tensor([ids])).logits[0].float()
    hf = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    vs_hf = (triton_lp - hf).abs().max().item()
    # perf/parity_by_kernel.py splits a failure by kernel family
    assert vs_reference < 2e-3 and vs_hf < 2e-3, f"max |dlogprob|: {vs_reference:.2e} vs reference, {vs_hf:.2e} vs hf"


def test_triton_bf16_error_is_the_reference_bf16_error(dense: TinyCheckpoint, monkeypatch) -> None:
    """bf16's error bound is the one the reference path itself shows in bf16, both against fp32: the
    Triton path may round differently, not worse (1.5x on the max and the mean, plus a little slack)."""
    ids = _prompt(300)
    exact = ninfer.load(dense.path, device="cuda", dtype=torch.float32, progress=False, cuda_graphs=False)
    llm = ninfer.load(dense.path, device="cuda", dtype=torch.bfloat16, progress=False, cuda_graphs=False)
    triton_err = (llm.score(ids) - exact.score(ids)).abs()
    monkeypatch.setenv("NINFER_KERNELS", "reference")
    ref_err = (llm.score(ids) - exact.score(ids)).abs()
    assert triton_err.max().item() <= 1.5 * ref_err.max().item() + 0.02, (triton_err.max(), ref_err.max())
    assert triton_err.mean().item() <= 1.5 * ref_err.mean().item() + 0.005, (triton_err.mean(), ref_err.mean())


@pytest.mark.parametrize("ckpt_name", ["dense", "moe"])
def test_engine_graphs_equal_eager_and_batched_equals_single(request, ckpt_name: str) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = [_prompt(n, seed=n) for n in (3, 90, 200, 17)]
    results = {}
    for graphs in (False, True):
        llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.float32, max_concurrency=3, cuda_graphs=graphs,
                          prefill_chunk=64, progress=False, prefix_cache=False)  # pools must drain
        assert (llm.engine.runner.graphs is not None) == graphs  # the runner captured (or not) the decode graphs
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


def test_prefix_checkpoints_inside_the_forward_resume_exactly(dense: TinyCheckpoint) -> None:
    """The chunked DeltaNet kernel writes a prefix-cache checkpoint mid-chunk (at the prompt's end, 149 of
    150 tokens, inside the chunk that starts at the 100-token interval mark); a longer prompt resumes there
    and decodes what the engine without a cache decodes."""
    kw = dict(device="cuda", dtype=torch.float32, max_concurrency=2, prefill_chunk=256, progress=False)
    plain = ninfer.load(dense.path, prefix_cache=False, **kw)
    llm = ninfer.load(dense.path, prefix_cache=True, checkpoint_interval=100, checkpoint_slots=4, **kw)
    prompt = _prompt(150, seed=21)
    longer = prompt + _prompt(40, seed=22)
    for p in (prompt, longer):
        got = llm._run([llm._request(p, 8, llm.sampling_params(greedy=True))])[0]
        want = plain._run([plain._request(p, 8, plain.sampling_params(greedy=True))])[0]
        assert got.token_ids == want.token_ids
    assert llm.engine.prefix.stats.hit_tokens == 149


def test_the_moe_model_decodes_bit_equal_with_the_small_kernels_waiting(moe: TinyCheckpoint, monkeypatch) -> None:
    """``NINFER_PDL_WAITS=1`` (:mod:`ninfer.kernels.pdl`): the norms, the MoE routing, the expert GEMV and the combine
    launched with programmatic dependent launch, waiting at their start, change when kernels start, never what they
    compute: the same tokens and logprobs from the captured graphs; and each of those kernels was launched so."""
    import ninfer.kernels.pdl as pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setenv("NINFER_PDL", "1")
    waited = []
    real = pdl.small_kernel_pdl
    outs = []
    for waits in ("0", "1"):
        monkeypatch.setenv("NINFER_PDL_WAITS", waits)
        for module in ("ninfer.kernels.norms", "ninfer.kernels.moe.routing", "ninfer.kernels.moe.gemm",
                       "ninfer.kernels.moe.quant_gemv"):
            monkeypatch.setattr(f"{module}.small_kernel_pdl", lambda device: waited.append(real(device)) or waited[-1])
        llm = ninfer.load(moe.path, device="cuda", dtype=torch.bfloat16, quantize="int4", progress=False,
                          max_concurrency=2)
        outs.append([llm.generate(_prompt(40, seed), max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
                     for seed in (8, 9)])
        del llm
        assert waited and all(p.wait == (waits == "1") and p.trigger for p in waited)
        assert all(p.options() == ({"launch_pdl": True} if p.wait else {}) for p in waited)
        waited.clear()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.logprobs]
