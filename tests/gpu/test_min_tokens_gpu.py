"""``min_tokens`` on the GPU: the mask goes onto device logits before the Triton sampler (which is unchanged),
with CUDA-graph decode steps and with MTP rounds; no stop comes before the minimum, other rows are untouched."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels.sampling import SamplingTensors, sample_triton, suppress_tokens
from bf16_oracle import assert_same_up_to_rounding
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
    """bf16: a row batched with others (or verified by MTP) may part from its lone run by rounding only
    (tests/bf16_oracle.py); the stop is never drawn before the minimum."""
    llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.bfloat16, max_concurrency=4, progress=False, **kw)
    lp = {"logprobs": 5}
    free_out = llm.generate([PROMPTS[0]], ninfer.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True,
                                                               **lp))[0].outputs[0]
    free = free_out.token_ids
    i = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    stop = free[i]
    greedy = ninfer.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop], **lp)
    early = llm.generate([PROMPTS[0]], greedy)[0].outputs[0]
    assert early.token_ids == free[:i + 1]  # alone both times: the same widths, so exactly the same
    held = ninfer.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop], min_tokens=MIN, **lp)
    sampled = ninfer.SamplingParams(temperature=1.0, seed=3, max_tokens=MAX, stop_token_ids=[stop], **lp)
    alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in ((PROMPTS[1], greedy), (PROMPTS[2], sampled))]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, [held, greedy, sampled])]
    assert len(outs[0].token_ids) > MIN and stop not in outs[0].token_ids[:MIN]
    # the held row's logprobs are renormalised without the stop id (-log(1 - p_stop) nats higher)
    assert_same_up_to_rounding(outs[0], free_out, greedy=True, upto=i, tol=0.7)
    assert_same_up_to_rounding(outs[1], alone[0], greedy=True)
    assert_same_up_to_rounding(outs[2], alone[1], greedy=False)
    if kw:  # MTP greedy equals plain greedy under min_tokens, up to the rounding of the K+1-row verification
        plain = ninfer.load(ckpt.path, device="cuda", dtype=torch.bfloat16, max_concurrency=4, progress=False)
        reference = plain.generate([PROMPTS[0]], held)[0].outputs[0]
        assert stop not in reference.token_ids[:MIN]
        assert_same_up_to_rounding(outs[0], reference, greedy=True)
