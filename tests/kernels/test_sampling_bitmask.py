"""The structured-output token bitmask inside the fused sampler (interpreter, fp32, one config) against the
reference: a packed xgrammar-layout mask with a row index per row (-1: unconstrained) must act exactly as
logits set to -inf before the sampler, for the draw, greedy ties, penalties, filters and logprobs."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.sampling import SamplingTensors, apply_bitmask, sample, sample_reference, sample_triton

V, VL = 1000, 990
WORDS = -(-V // 32)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's layout: bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed."""
    bits = torch.zeros(allowed.shape[0], WORDS * 32, dtype=torch.int64)
    bits[:, :allowed.shape[1]] = allowed.long()
    words = (bits.view(-1, WORDS, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _case(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, the packed mask of R = batch + 2 rows (shuffled, so row b's mask is not row b), the
    row index per row, and the allowed set each row must respect (all True where unconstrained)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, V, generator=g) * 3
    logits[:, VL:] = 50.0  # padding with the largest logits: choosing one is visible
    rows = batch + 2
    allowed = torch.rand(rows, V, generator=g) < 0.3
    allowed[0] = False
    allowed[0, int(torch.randint(0, VL, (1,), generator=g))] = True  # a single allowed token
    allowed[1] = True  # all allowed
    allowed[2] = False
    allowed[2, torch.randperm(VL, generator=g)[:3]] = True
    allowed[3, :] = False
    allowed[3, 400:440] = True  # one contiguous run, inside a chunk boundary region
    # Garbage bits past the vocabulary must be ignored.
    bitmask = pack(allowed)
    bitmask[:, -1] |= torch.tensor(-1 << (V % 32), dtype=torch.int32)
    perm = torch.randperm(rows, generator=g).to(torch.int32)
    mask_rows = perm[:batch].clone()
    mask_rows[torch.arange(batch) % 4 == 3] = -1  # unconstrained rows mixed in
    row_allowed = torch.where((mask_rows >= 0)[:, None], allowed[mask_rows.long().clamp(min=0)], True)
    return logits, bitmask, mask_rows, row_allowed


def _rows(batch: int) -> SamplingTensors:
    st = SamplingTensors.full(batch, seed=11)
    r = torch.arange(batch)
    st.temperature.copy_(torch.tensor([0.0, 0.7, 1.0, 1.6, 0.0])[r % 5])
    st.top_k.copy_(torch.tensor([0, 1, 5, 200, 0, 0])[r % 6])
    st.top_p.copy_(torch.tensor([1.0, 0.5, 0.95])[r % 3])
    st.min_p.copy_(torch.tensor([0.0, 0.1])[r % 2])
    st.repetition_penalty.copy_(1.0 + 0.3 * (r % 3 == 2))
    st.presence_penalty.copy_(0.5 * (r % 2))
    st.counter.copy_(r * 5)
    return st


def _state(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    counts = torch.randint(0, 2, (batch, V), generator=g, dtype=torch.int32)
    return counts, (counts > 0).to(torch.int8)


def test_apply_bitmask_is_the_allowed_set() -> None:
    logits, bitmask, mask_rows, row_allowed = _case(8, 0)
    masked = apply_bitmask(logits, bitmask, mask_rows)
    assert torch.equal(masked, logits.masked_fill(~row_allowed, float("-inf")))


@pytest.mark.parametrize("num_logprobs", [0, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_mask_equals_masked_logits(seed: int, num_logprobs: int) -> None:
    """The bitmask inside the kernel is bit-for-bit the kernel run on pre-masked logits (tokens, logprobs,
    top logprobs, advanced state), and it respects every allowed set; greedy rows equal the reference."""
    batch = 12
    logits, bitmask, mask_rows, row_allowed = _case(batch, seed)
    pre = logits.masked_fill(~row_allowed, float("-inf"))
    kw = dict(vocab_limit=VL, num_logprobs=num_logprobs, chunk=256, candidates=16)
    outs, states = [], []
    for x, extra in ((logits, dict(bitmask=bitmask, mask_rows=mask_rows)), (pre, {})):
        st, (counts, seen) = _rows(batch), _state(batch, seed)
        x_in = x.clone()
        outs.append(sample_triton(x_in, st, counts, seen, **kw, **extra))
        assert torch.equal(x_in, x)  # the mask never writes the logits
        states.append((st.counter, counts, seen))
    got, want = outs
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.logprob, want.logprob)
    if num_logprobs:
        assert torch.equal(got.top_ids, want.top_ids) and torch.equal(got.top_logprobs, want.top_logprobs)
    for a, b in zip(*states):
        assert torch.equal(a, b)
    assert bool(row_allowed[torch.arange(batch), got.token_ids].all())
    assert bool((got.token_ids < VL).all())

    st, (counts, seen) = _rows(batch), _state(batch, seed)
    ref = sample_reference(logits.clone(), st, counts, seen, vocab_limit=VL, num_logprobs=num_logprobs,
                           bitmask=bitmask, mask_rows=mask_rows)
    greedy = _rows(batch).temperature <= 0
    assert torch.equal(got.token_ids[greedy], ref.token_ids[greedy])
    assert bool(row_allowed[torch.arange(batch), ref.token_ids].all())
    # logprobs: the constrained distribution (log_softmax of the masked raw logits)
    raw = torch.log_softmax(pre[:, :VL], dim=-1)
    rows = torch.arange(batch)
    torch.testing.assert_close(got.logprob, raw[rows, got.token_ids], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.logprob, raw[rows, ref.token_ids], rtol=1e-5, atol=1e-5)
    if num_logprobs:
        assert torch.equal(got.top_ids, ref.top_ids)
        torch.testing.assert_close(got.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
    single = (mask_rows >= 0) & (row_allowed.sum(1) == 1)
    assert torch.equal(got.token_ids[single], row_allowed[single].float().argmax(1))


def test_sample_reference_mask_equals_masked_logits() -> None:
    batch = 10
    logits, bitmask, mask_rows, row_allowed = _case(batch, 5)
    pre = logits.masked_fill(~row_allowed, float("-inf"))
    outs = []
    for x, extra in ((logits, dict(bitmask=bitmask, mask_rows=mask_rows)), (pre, {})):
        st, (counts, seen) = _rows(batch), _state(batch, 5)
        outs.append(sample(x.clone(), st, counts, seen, vocab_limit=VL, num_logprobs=3, **extra))
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert torch.equal(outs[0].logprob, outs[1].logprob)
    assert torch.equal(outs[0].top_ids, outs[1].top_ids)


def test_mask_arguments_are_checked() -> None:
    logits, bitmask, mask_rows, _ = _case(4, 0)
    st, (counts, seen) = _rows(4), _state(4, 0)
    with pytest.raises(ValueError):
        sample_reference(logits, st, counts, seen, vocab_limit=VL, bitmask=bitmask)
    with pytest.raises(ValueError):
        sample_triton(logits, st, counts, seen, vocab_limit=VL, bitmask=bitmask[:, :-1], mask_rows=mask_rows)
