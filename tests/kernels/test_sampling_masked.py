"""Structured output masks logits to -inf before the sampler: the Triton sampler (interpreter) and the
reference then draw only allowed tokens, whatever the filters and penalties of the row."""
from __future__ import annotations

import torch

from ninfer.kernels.sampling import SamplingTensors, sample_reference, sample_triton

V, VL = 1000, 990


def _masked(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with few allowed ids per row (1 to 40, anywhere below VL); the rest -inf."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, V, generator=g) * 3
    allowed = torch.zeros(batch, V, dtype=torch.bool)
    for b in range(batch):
        n = [1, 2, 3, 40][b % 4]
        allowed[b, torch.randperm(VL, generator=g)[:n]] = True
    return logits.masked_fill(~allowed, float("-inf")), allowed


def _rows(batch: int) -> SamplingTensors:
    st = SamplingTensors.full(batch, seed=3)
    r = torch.arange(batch)
    st.temperature.copy_(torch.tensor([0.0, 0.7, 1.0, 1.6])[r % 4])
    st.top_k.copy_(torch.tensor([0, 1, 5, 50, 0])[r % 5])
    st.top_p.copy_(torch.tensor([1.0, 0.5, 0.95])[r % 3])
    st.min_p.copy_(torch.tensor([0.0, 0.1])[r % 2])
    st.repetition_penalty.copy_(1.0 + 0.3 * (r % 3 == 2))
    st.presence_penalty.copy_(0.5 * (r % 2))
    st.counter.copy_(r * 7)
    return st


def test_masked_rows_draw_only_allowed_tokens() -> None:
    batch = 24
    for seed in range(3):
        logits, allowed = _masked(batch, seed)
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, 2, (batch, V), generator=g, dtype=torch.int32)
        seen = (counts > 0).to(torch.int8)
        for draw in (lambda st, c, s: sample_triton(logits.clone(), st, c, s, vocab_limit=VL, chunk=256,
                                                     candidates=16),
                     lambda st, c, s: sample_reference(logits.clone(), st, c, s, vocab_limit=VL)):
            st = _rows(batch)
            out = draw(st, counts.clone(), seen.clone())
            assert bool(allowed[torch.arange(batch), out.token_ids].all()), seed
            greedy = st.temperature == 0
            best = logits.argmax(1)
            assert torch.equal(out.token_ids[greedy & (torch.arange(batch) % 3 != 2)],
                               best[greedy & (torch.arange(batch) % 3 != 2)])
            assert bool(torch.isfinite(out.logprob).all())
