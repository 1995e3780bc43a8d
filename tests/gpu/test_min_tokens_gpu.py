"""``min_tokens`` on the GPU: the mask goes onto device logits before the Triton sampler (which is unchanged),
with CUDA-graph decode steps and with MTP rounds; no stop comes before the minimum, other rows are untouched."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels.sampling import SamplingTensors, sample_triton, suppress_tokens
from tiny_checkpoints import make_composite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 33, 99, 12, 7, 201, 45], list(range(20, 57)), [300, 301, 302]]
MIN, MAX = 12, 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_composite(tmp_path_factory.mktemp("gmin"), seed=5)


def test_triton_sampler_never_draws_a_suppressed_id() -> None:
    torch.manual_seed(0)
    b, v, vocab_limit = 6, 248320, 248000
    logits = torch.randn(b, v, device="cuda") * 3
    stop = 1234
    logits[:, stop] = 30.0  # the stop id all but certain in every row
    st = SamplingTensors.full(b, device="cuda", temperature=1.0, seed=9)
    st.temperature[0] = 0.0  # one greedy row
    counts = torch.zeros(b, v, dtype=torch.int32, device="cuda")
    seen = torch.zeros(b, v, dtype=torch.int8, device="cuda")
    def fresh() -> SamplingTensors:  # a launch advances the counters in place: each starts from the same state
        return SamplingTensors(**{k: t.clone() for k, t in vars(st).items()})

    free = sample_triton(logits.clone(), fresh(), counts.clone(), seen.clone(), vocab_limit=vocab_limit).token_ids
    assert (free == stop).all()
    masked = logits.clone()
    rows = torch.tensor([0, 2, 3], device="cuda")  # rows 1, 4, 5 are not under min_tokens
    suppress_tokens(masked, rows, torch.arange(3, device="cuda"), torch.full((3,), stop, device="cuda"),
                    vocab_limit=vocab_limit)
    got = sample_triton(masked, fresh(), counts, seen, vocab_limit=vocab_limit).token_ids
    assert (got[rows] != stop).all() and (got[[1, 4, 5]] == free[[1, 4, 5]]).all()
    plain = logits.clone()
    plain[0, stop] = float("-inf")
    assert int(got[0]) == int(plain[0, :vocab_limit].argmax())


@pytest.mark.parametrize("kw", [{}, {"spec": "mtp", "draft_tokens": 3}], ids=["graphs", "mtp"])
def test_min_tokens_with_graphs_and_mtp(ckpt, kw: dict) -> None:
    llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.bfloat16, max_concurrency=4, progress=False, **kw)
    free = llm.generate([PROMPTS[0]], ninfer.SamplingParams(temperature=0, max_tokens=MAX,
                                                           ignore_eos=True))[0].outputs[0].token_ids
    i = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    stop = free[i]
    greedy = ninfer.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop])
    early = llm.generate([PROMPTS[0]], greedy)[0].outputs[0]
    assert early.token_ids == free[:i + 1]
    held = ninfer.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop], min_tokens=MIN)
    sampled = ninfer.SamplingParams(temperature=1.0, seed=3, max_tokens=MAX, stop_token_ids=[stop])
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in ((PROMPTS[1], greedy), (PROMPTS[2], sampled))]
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [held, greedy, sampled])]
    assert len(outs[0]) > MIN and stop not in outs[0][:MIN] and outs[0][:i] == free[:i]
    assert outs[1:] == alone
    if kw:  # MTP greedy equals plain greedy under min_tokens
        plain = ninfer.load(ckpt.path, device="cuda", dtype=torch.bfloat16, max_concurrency=4, progress=False)
        assert plain.generate([PROMPTS[0]], held)[0].outputs[0].token_ids == outs[0]
