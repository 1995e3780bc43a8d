"""Structured output on the GPU: the mask is applied to device logits before the Triton sampler, with
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
