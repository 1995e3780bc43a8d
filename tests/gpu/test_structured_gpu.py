"""Structured output on the GPU: the token bitmask applied inside the fused Triton sampler, with
CUDA-graph decode steps and with speculative rounds; every answer conforms."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import ninfer
from ninfer.runtime.sampling import SamplingParams
from ninfer.runtime.structured import Constraint
from bf16_oracle import assert_same_up_to_rounding
from tiny_checkpoints import make_composite

xgr = pytest.importorskip("xgrammar")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 3}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
PROMPTS = [[5, 17, 33, 99], [300, 301, 302, 7, 8], list(range(20, 60))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_composite(tmp_path_factory.mktemp("gstruct"), seed=5)


@pytest.mark.parametrize("kw", [{}, {"spec": "mtp", "draft_tokens": 3}], ids=["graphs", "mtp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_constrained_and_free_rows_on_the_gpu(ckpt, kw: dict, dtype: torch.dtype) -> None:
    llm = ninfer.load(ckpt.path, device="cuda", dtype=dtype, max_concurrency=4, progress=False, **kw)
    c = Constraint.json_schema(SCHEMA)
    params = [SamplingParams(temperature=0.0, structured=c), SamplingParams(temperature=1.0, seed=3, structured=c),
              SamplingParams(temperature=1.0, seed=4, logprobs=5)]
    reqs = [llm._request(p, 48, sp) for p, sp in zip(PROMPTS, params)]
    outs = llm._run(reqs)
    free_alone = llm._run([llm._request(PROMPTS[2], 48, params[2])])[0]
    # the free row is not touched by its neighbours' masks (bf16: batch widths round differently)
    if dtype == torch.float32:
        assert outs[2].token_ids == free_alone.token_ids
    else:
        assert_same_up_to_rounding(outs[2], free_alone, greedy=False)
    for out in outs[:2]:
        matcher = xgr.GrammarMatcher(llm.structured.compile(c))
        assert all(matcher.accept_token(t) for t in out.token_ids)
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        assert isinstance(value["tag"], str) and len(value["tag"]) <= 3
    again = llm._run([llm._request(PROMPTS[0], 48, dataclasses.replace(params[0]))])[0]
    assert again.token_ids == outs[0].token_ids


def _random_bitmask(rows: int, vocab: int, limit: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed xgrammar-layout bitmask (int32, bit ``t % 32`` of word ``t // 32``) and its bool form:
    sparse rows, a single-token row and an all-allowed row."""
    words = -(-vocab // 32)
    density = torch.tensor([0.001, 0.05, 0.5, 1.0])[torch.arange(rows) % 4, None]
    allowed = torch.rand(rows, words * 32, generator=g) < density
    allowed[:, 0] = True  # every row has an allowed id below the padding
    allowed[0] = False
    allowed[0, int(torch.randint(0, limit, (1,), generator=g))] = True
    bits = (allowed.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    packed = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    return packed, allowed[:, :vocab]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_mask_greedy_equals_torch_masked_reference(graph: bool, dtype: torch.dtype) -> None:
    """Constrained greedy (and sampled rows' allowed sets) through the fused kernel's bitmask equal the
    reference on torch-masked logits at the real vocabulary (248,320, ids >= 248,077 padding), batch 8,
    unconstrained rows mixed in; logprobs are the masked distribution's. Outputs are poisoned first."""
    from ninfer.kernels.sampling import SamplingTensors, apply_bitmask, sample_reference, sample_triton

    V, VL, B = 248320, 248077, 8
    g = torch.Generator().manual_seed(int(graph) * 2 + (dtype == torch.bfloat16))
    logits = torch.empty(B, V, dtype=dtype, device="cuda")
    bitmask = torch.empty(B + 3, -(-V // 32), dtype=torch.int32, device="cuda")
    mask_rows = torch.empty(B, dtype=torch.int32, device="cuda")
    st = SamplingTensors.full(B, "cuda", seed=9)
    counts = torch.zeros(B, V, dtype=torch.int32, device="cuda")
    seen = torch.zeros(B, V, dtype=torch.int8, device="cuda")

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        logits.copy_((torch.randn(B, V, generator=g) * 3).to(dtype))
        packed, allowed = _random_bitmask(B + 3, V, VL, g)
        bitmask.copy_(packed)
        rows = torch.randperm(B + 3, generator=g)[:B].to(torch.int32)
        rows[torch.tensor([2, 5])] = -1  # unconstrained rows
        mask_rows.copy_(rows)
        st.temperature.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.7, 1.0, 0.0]))
        st.top_k.copy_(torch.tensor([0, 0, 0, 0, 20, 0, 0, 0], dtype=torch.int32))
        st.top_p.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 0.95, 1.0, 1.0]))
        counts.zero_()
        seen.zero_()
        row_allowed = torch.where((rows >= 0)[:, None], allowed[rows.long().clamp(min=0)], True)
        return rows, row_allowed

    def run():
        return sample_triton(logits, st, counts, seen, vocab_limit=VL, num_logprobs=4, bitmask=bitmask,
                             mask_rows=mask_rows)

    rows, row_allowed = fresh()
    out = run()  # compiles and allocates the workspace outside capture
    if graph:
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            out = run()
    for _ in range(3):
        rows, row_allowed = fresh()
        if graph:
            for t in (out.token_ids, out.top_ids):
                t.fill_(-1)
            for t in (out.logprob, out.top_logprobs):
                t.fill_(float("nan"))
            cuda_graph.replay()
            got = out
        else:
            got = run()
        torch.cuda.synchronize()
        tok = got.token_ids.cpu()
        masked = apply_bitmask(logits, bitmask, mask_rows)
        ref_st = SamplingTensors.full(B, "cuda", seed=9)
        ref_st.temperature.copy_(st.temperature)
        ref = sample_reference(masked.float(), ref_st, torch.zeros_like(counts), torch.zeros_like(seen),
                               vocab_limit=VL, num_logprobs=4)
        greedy = (st.temperature <= 0).cpu()
        assert torch.equal(tok[greedy], ref.token_ids.cpu()[greedy])
        assert bool(row_allowed[torch.arange(B), tok].all()) and bool((tok < VL).all())
        raw = torch.log_softmax(masked[:, :VL].float(), dim=-1)
        torch.testing.assert_close(got.logprob, raw[torch.arange(B, device="cuda"), got.token_ids], rtol=1e-4,
                                   atol=1e-4)
        assert torch.equal(got.top_ids, ref.top_ids)
        torch.testing.assert_close(got.top_logprobs, ref.top_logprobs, rtol=1e-4, atol=1e-4)
        single = (rows >= 0) & (row_allowed.sum(1) == 1)
        assert torch.equal(tok[single], row_allowed[single].float().argmax(1))
