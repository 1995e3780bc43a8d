"""The Triton sampler (interpreter, small vocabularies) against the torch reference's semantics.

Small ``chunk`` / ``candidates`` make the kernel's rarely used paths run: thresholds below the
merged candidates (row searches, collection into the workspace) and the unfiltered chunk draw.
"""
from __future__ import annotations

import torch
from scipy.stats import chisquare

from ninfer.kernels.sampling import (
    SamplingTensors,
    apply_penalties_reference,
    sample,
    sample_reference,
    sample_triton,
    sampling_probs_reference,
)

V, VL = 1000, 990  # ids >= VL are padding and get the largest logits, so choosing one is visible


def _logits(batch: int, vocab: int, scale: torch.Tensor | float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g) * (scale[:, None] if torch.is_tensor(scale) else scale)
    x[:, VL:] = 50.0 if vocab == V else x[:, VL:]
    return x


def _state(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (batch, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(batch, vocab, generator=g) < 0.1
    seen = ((counts > 0) | (torch.rand(batch, vocab, generator=g) < 0.1)).to(torch.int8)
    return counts, seen


def _mixed_rows(batch: int, seed: int) -> SamplingTensors:
    """Rows cycling through filter combinations and penalties."""
    g = torch.Generator().manual_seed(seed)
    st = SamplingTensors.full(batch, seed=seed)
    top_k = torch.tensor([0, 1, 5, 20, 100, 400])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.99, 0.2])
    min_p = torch.tensor([0.0, 0.0, 0.02, 0.3])
    r = torch.arange(batch)
    st.top_k.copy_(top_k[r % 6])
    st.top_p.copy_(top_p[r % 5])
    st.min_p.copy_(min_p[r % 4])
    st.temperature.copy_(torch.tensor([0.6, 1.0, 1.7])[r % 3])
    st.presence_penalty.copy_(torch.rand(batch, generator=g) * (r % 2))
    st.frequency_penalty.copy_(torch.rand(batch, generator=g) * 0.5 * (r % 3 == 1))
    st.repetition_penalty.copy_(1.0 + 0.5 * (r % 4 == 3))
    st.counter.copy_(torch.randint(0, 1000, (batch,), generator=g))
    return st


def _clone(st: SamplingTensors) -> SamplingTensors:
    return SamplingTensors(*(t.clone() for t in vars(st).values()))


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    counts = torch.tensor([[0, 2, 1, 0, 0]], dtype=torch.int32)
    seen = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.int8)
    st = SamplingTensors.full(1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    z = apply_penalties_reference(logits, st, counts, seen)
    # positive seen logits halve, negative ones double; then count * 0.25 and 0.5 if generated
    expected = torch.tensor([[1.0, -4.0 - 0.5 - 0.5, 3.0 - 0.25 - 0.5, -2.0, 0.5]])
    assert torch.equal(z, expected)


def test_greedy_is_argmax_of_penalised_logits_and_updates_state() -> None:
    batch = 3
    logits = _logits(batch, V, 2.0, seed=0)
    counts, seen = _state(batch, V, seed=1)
    top = logits[:, :VL].argmax(-1)
    counts[0, top[0]] = 1  # presence penalty moves row 0's argmax elsewhere
    seen[1, top[1]] = 1  # repetition penalty on row 1's positive argmax
    logits[2, :VL] = -logits[2, :VL].abs() - 0.1  # all negative: repetition multiplies
    seen[2] = 0
    seen[2, logits[2, :VL].argmax()] = 1
    st = SamplingTensors.full(batch, temperature=0.0, presence_penalty=5.0, repetition_penalty=3.0, seed=4)
    st.presence_penalty[1:] = 0.0
    expected = apply_penalties_reference(logits[:, :VL], st, counts[:, :VL], seen[:, :VL]).argmax(-1)
    assert not torch.equal(expected, logits[:, :VL].argmax(-1))
    counts0, seen0, counter0 = counts.clone(), seen.clone(), st.counter.clone()
    out = sample_triton(logits, st, counts, seen, vocab_limit=VL, chunk=256, candidates=16)
    assert torch.equal(out.token_ids, expected)
    raw = torch.log_softmax(logits[:, :VL], -1)
    assert torch.allclose(out.logprob, raw[torch.arange(batch), expected], rtol=1e-5, atol=1e-5)
    rows = torch.arange(batch)
    counts0[rows, expected] += 1
    seen0[rows, expected] = 1
    assert torch.equal(counts, counts0) and torch.equal(seen, seen0)
    assert torch.equal(st.counter, counter0 + 1)


def test_top_k_one_equals_greedy() -> None:
    batch = 3
    logits = _logits(batch, V, 1.0, seed=2)
    counts, seen = _state(batch, V, seed=3)
    st = SamplingTensors.full(batch, temperature=0.8, top_k=1, presence_penalty=1.0, repetition_penalty=1.2, seed=9)
    st.top_p[0] = 0.5
    st.min_p[1] = 0.1
    expected = apply_penalties_reference(logits[:, :VL], st, counts[:, :VL], seen[:, :VL]).argmax(-1)
    out = sample_triton(logits, st, counts, seen, vocab_limit=VL, chunk=256, candidates=16)
    assert torch.equal(out.token_ids, expected)


def test_sampled_token_lies_in_reference_allowed_set() -> None:
    batch = 30  # 30 distinct (top_k, top_p, min_p, temperature) combinations
    logits = _logits(batch, V, torch.tensor([0.3, 1.0, 3.0])[torch.arange(batch) % 3], seed=10)
    counts, seen = _state(batch, V, seed=20)
    st = _mixed_rows(batch, seed=0)
    allowed = sampling_probs_reference(logits, st, counts, seen, vocab_limit=VL) > 0
    out = sample_triton(logits, st, counts, seen, vocab_limit=VL, chunk=256, candidates=16)
    assert bool((out.token_ids < VL).all())
    assert bool(allowed[torch.arange(batch), out.token_ids].all())


def test_kept_set_is_exact_when_thresholds_fall_below_the_candidates() -> None:
    """Each config's draws (one per counter) must cover exactly the reference's allowed set.

    Six near-equal head logits spread over two chunks that keep two candidates each: every
    filter below needs a row search and a collection into the workspace.
    """
    vocab, draws = 16, 32
    base = torch.linspace(0.0, -2.0, vocab)
    head = torch.tensor([1, 6, 9, 12, 3, 14])
    base[head] = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6, 2.5])
    configs = [dict(top_p=0.45), dict(top_k=5), dict(min_p=0.7), dict(top_k=5, top_p=0.6, min_p=0.5)]
    sizes = [3, 5, 4, 3]
    st = SamplingTensors.full(len(configs) * draws, seed=123)
    for i, cfg in enumerate(configs):
        for name, value in cfg.items():
            getattr(st, name)[i * draws:(i + 1) * draws] = value
    st.counter.copy_(torch.arange(len(configs) * draws))
    logits = base.expand(len(configs) * draws, vocab).contiguous()
    counts = torch.zeros(logits.shape, dtype=torch.int32)
    seen = torch.zeros(logits.shape, dtype=torch.int8)
    allowed = sampling_probs_reference(logits, st, counts, seen, vocab_limit=vocab) > 0
    out = sample_triton(logits, st, counts, seen, vocab_limit=vocab, chunk=8, candidates=2)
    for i, size in enumerate(sizes):
        expected = set(allowed[i * draws].nonzero().flatten().tolist())
        assert expected == set(head[:size].tolist())
        assert set(out.token_ids[i * draws:(i + 1) * draws].tolist()) == expected, configs[i]


def test_draws_follow_the_filtered_distribution() -> None:
    """Chi-square of 200 draws per config; one config is unfiltered (chunk chosen, then rescanned)."""
    vocab, draws = 12, 200
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    configs = [dict(top_k=6, top_p=0.9, presence_penalty=0.7), dict(temperature=1.3)]
    st = SamplingTensors.full(len(configs) * draws, temperature=0.9, seed=77)
    for i, cfg in enumerate(configs):
        for name, value in cfg.items():
            getattr(st, name)[i * draws:(i + 1) * draws] = value
    st.counter.copy_(torch.arange(len(configs) * draws) * 3)
    logits = base.expand(len(configs) * draws, vocab).contiguous()
    counts = torch.zeros(logits.shape, dtype=torch.int32)
    counts[:, :3] = torch.tensor([2, 0, 1], dtype=torch.int32)
    seen = torch.zeros(logits.shape, dtype=torch.int8)
    probs = sampling_probs_reference(logits, st, counts, seen, vocab_limit=vocab)
    out = sample_triton(logits, st, counts, seen, vocab_limit=vocab, chunk=16, candidates=16)
    for i in range(len(configs)):
        p = probs[i * draws]
        observed = torch.bincount(out.token_ids[i * draws:(i + 1) * draws], minlength=vocab).double()
        keep = p > 0
        assert observed[~keep].sum() == 0
        assert chisquare(observed[keep].numpy(), (p[keep] * draws).numpy()).pvalue > 1e-3, configs[i]


def test_same_seed_and_counter_give_the_same_token_whatever_the_batch() -> None:
    logits = _logits(4, V, 1.0, seed=30)
    counts, seen = _state(4, V, seed=31)
    st = SamplingTensors.full(4, temperature=1.2, top_k=50, top_p=0.95, seed=99, counter=7)
    st.seed[1:] = torch.tensor([5, 6, 7])
    first = sample_triton(logits.clone(), _clone(st), counts.clone(), seen.clone(), vocab_limit=VL, chunk=256,
                          candidates=16)
    # Same row 0 next to different rows, and alone.
    others = _logits(4, V, 3.0, seed=32)
    others[0] = logits[0]
    st2 = _clone(st)
    st2.top_k[1:] = 0
    st2.temperature[1:] = 0.5
    second = sample_triton(others, st2, counts.clone(), seen.clone(), vocab_limit=VL, chunk=256, candidates=16)
    alone = sample_triton(logits[:1].clone(), SamplingTensors(*(t[:1].clone() for t in vars(st).values())),
                          counts[:1].clone(), seen[:1].clone(), vocab_limit=VL, chunk=256, candidates=16)
    assert first.token_ids[0] == second.token_ids[0] == alone.token_ids[0]
    # The counter moves the draw: consecutive calls on the same state do not all repeat.
    st3 = SamplingTensors(*(t[:1].clone() for t in vars(st).values()))
    c3, s3 = counts[:1].clone(), seen[:1].clone()
    toks = [int(sample_triton(logits[:1], st3, c3, s3, vocab_limit=VL, chunk=256, candidates=16).token_ids[0])
            for _ in range(4)]
    assert len(set(toks)) > 1 and int(st3.counter[0]) == 11


def test_logprobs_are_the_raw_distribution() -> None:
    batch, n = 3, 7
    logits = _logits(batch, V, 2.0, seed=40)
    logits[1, 10] = logits[1, 20] = logits[1, :VL].max() + 1.0  # a tie: lower id first
    counts, seen = _state(batch, V, seed=41)
    st = SamplingTensors.full(batch, temperature=0.7, top_p=0.9, presence_penalty=0.4, seed=3)
    out = sample_triton(logits, st, counts, seen, vocab_limit=VL, num_logprobs=n, chunk=256, candidates=16)
    raw = torch.log_softmax(logits[:, :VL], -1)
    ref = raw.topk(n, dim=-1)
    assert torch.allclose(out.top_logprobs, ref.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.top_ids[:, 0], ref.indices[:, 0].where(torch.arange(batch) != 1, torch.tensor(10)))
    assert out.top_ids[1, 1] == 20
    assert bool((out.top_ids < VL).all())
    assert torch.allclose(out.logprob, raw[torch.arange(batch), out.token_ids], rtol=1e-5, atol=1e-5)


def test_fp16_logits_and_bool_seen() -> None:
    batch = 2
    logits = _logits(batch, V, 2.0, seed=50).half()
    counts, seen = _state(batch, V, seed=51)
    seen = seen.bool()
    st = SamplingTensors.full(batch, temperature=0.0, repetition_penalty=1.5)
    expected = apply_penalties_reference(logits[:, :VL], st, counts[:, :VL], seen[:, :VL]).argmax(-1)
    out = sample_triton(logits, st, counts, seen, vocab_limit=VL, chunk=256, candidates=16)
    assert torch.equal(out.token_ids, expected)
    assert bool(seen[torch.arange(batch), expected].all())


def test_reference_path_is_batch_independent_and_greedy_agrees() -> None:
    logits = _logits(3, V, 1.0, seed=60)
    counts, seen = _state(3, V, seed=61)
    st = _mixed_rows(3, seed=2)
    st.seed.copy_(torch.tensor([1, 2, 3]))
    whole = sample(logits, _clone(st), counts.clone(), seen.clone(), vocab_limit=VL, num_logprobs=3)
    alone = sample_reference(logits[2:], SamplingTensors(*(t[2:].clone() for t in vars(st).values())),
                             counts[2:].clone(), seen[2:].clone(), vocab_limit=VL)
    assert whole.token_ids[2] == alone.token_ids[0]
    assert whole.top_ids.shape == (3, 3)
    greedy = SamplingTensors.full(3, temperature=0.0, presence_penalty=1.0)
    a = sample_reference(logits, _clone(greedy), counts.clone(), seen.clone(), vocab_limit=VL)
    b = sample_triton(logits, _clone(greedy), counts.clone(), seen.clone(), vocab_limit=VL, chunk=256, candidates=16)
    assert torch.equal(a.token_ids, b.token_ids)
