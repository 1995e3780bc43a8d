"""The sampler's top-logprob counts come in classes (one compiled kernel each, warmed at start-up): any count
gives the first entries of its class's launch, equal to the reference's top entries, and nothing more."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.sampling import SamplingTensors, sample_reference, sample_triton
from ninfer.kernels.sampling.dispatch import LOGPROB_CLASSES, MAX_LOGPROBS, logprob_class

V, VL = 1000, 990


def test_every_count_has_the_smallest_class_that_holds_it() -> None:
    assert [logprob_class(n) for n in range(MAX_LOGPROBS + 1)] == \
        [0, 1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 20, 20, 20, 20]
    assert LOGPROB_CLASSES[-1] == MAX_LOGPROBS


@pytest.mark.parametrize("n", [3, 5, 17])
def test_a_count_inside_a_class_is_the_reference_top_n(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(2, V, generator=g) * 3.0
    logits[0, 10] = logits[0, 20] = logits[0, :VL].max() + 1.0  # a tie: lower id first
    st = SamplingTensors.full(2, temperature=0.8, seed=5)
    zeros = (torch.zeros(2, V, dtype=torch.int32), torch.zeros(2, V, dtype=torch.uint8))
    out = sample_triton(logits, st, *zeros, vocab_limit=VL, num_logprobs=n, chunk=256, candidates=16)
    ref = sample_reference(logits, SamplingTensors.full(2, temperature=0.8, seed=5),
                           torch.zeros(2, V, dtype=torch.int32), torch.zeros(2, V, dtype=torch.uint8),
                           vocab_limit=VL, num_logprobs=n)
    assert out.top_ids.shape == (2, n) and out.top_logprobs.shape == (2, n)
    assert torch.equal(out.top_ids, ref.top_ids)
    assert torch.allclose(out.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
    assert out.top_ids[0, :2].tolist() == [10, 20]
