"""MTP speculative decoding through the engine: outputs equal plain decoding, token for token.

Random tiny checkpoints' MTP heads almost never agree with their targets, so besides the real
head two test-only drafters drive the other paths through ``MTPSpeculator.propose``: an oracle
that proposes the plain run's own tokens (every draft accepted) and a saboteur that proposes the
plain tokens up to a cut that cycles through 0..K (every acceptance count, every rejection slot).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import ninfer
from ninfer.runtime.request import Request
from ninfer.runtime.sampling import SamplingParams
from ninfer.runtime.speculative import force_acceptance

GREEDY = SamplingParams(greedy=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
PENALISED = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, presence_penalty=0.4, seed=7)
PROMPTS = [[5, 17, 33, 99, 12, 7, 201, 45], list(range(20, 57)), [300, 301, 302]]


def _load(ckpt, **kw) -> ninfer.LLM:
    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512) | kw
    return ninfer.load(ckpt.path, **kw)


def _requests(llm, params: SamplingParams, max_new: int = 24, **kw) -> list[Request]:
    return [llm._request(list(p), max_new, params, **kw) for p in PROMPTS]


def _run(llm, reqs: list[Request]) -> list[list[int]]:
    return [c.token_ids for c in llm._run(reqs)]


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request):
    return request.getfixturevalue("composite_ckpt" if request.param == "dense" else "composite_moe_ckpt")


@pytest.fixture(scope="module")
def plain(ckpt):
    """The non-speculative engine over the same checkpoint: the oracle."""
    return _load(ckpt)


def _install(llm, reqs: list[Request], plain_outputs: list[list[int]], cut: itertools.cycle | None) -> None:
    """Draft from the plain run's tokens: all of them (``cut`` None) or the first ``next(cut)``, then wrong ones."""
    full = {r.request_id: r.prompt_ids + out for r, out in zip(reqs, plain_outputs)}
    vocab = llm.valid_vocab

    def propose(lanes: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        by_lane = {r.lane: full[r.request_id] for r in reqs if r.lane is not None}
        out = drafts.clone()
        for b, (lane, pos) in enumerate(zip(lanes.tolist(), n.tolist())):
            seq = by_lane[lane]
            good = next(cut) if cut is not None else drafts.shape[1]
            for i in range(drafts.shape[1]):
                truth = seq[pos + 1 + i] if pos + 1 + i < len(seq) else 0
                out[b, i] = truth if i < good else (truth + 1 + i) % vocab
        return out

    llm.engine.spec.propose = propose


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_the_real_head_equals_plain(ckpt, plain, k: int) -> None:
    want = _run(plain, _requests(plain, GREEDY))
    llm = _load(ckpt, spec="mtp", draft_tokens=k)
    reqs = _requests(llm, GREEDY)
    assert _run(llm, reqs) == want
    assert all(r.spec_stats.rounds > 0 and r.spec_stats.drafted == k * r.spec_stats.rounds for r in reqs)
    assert llm.engine.is_idle()


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["oracle", "saboteur"])
def test_greedy_with_test_drafters_equals_plain(ckpt, plain, k: int, drafter: str) -> None:
    want = _run(plain, _requests(plain, GREEDY, max_new=40))
    llm = _load(ckpt, spec="mtp", draft_tokens=k)
    reqs = _requests(llm, GREEDY, max_new=40)
    _install(llm, reqs, want, None if drafter == "oracle" else itertools.cycle(range(k + 1)))
    assert _run(llm, reqs) == want
    stats = llm.engine.spec_totals
    if drafter == "oracle":  # every draft accepted (the last round may run past the known tokens)
        assert stats.accepted >= stats.drafted - k * len(reqs)
        assert all(r.spec_stats.rounds <= -(-len(o) // (k + 1)) + 1 for r, o in zip(reqs, want))
    else:  # every acceptance count 0..K happened, so every rollback slot was used
        assert 0 < stats.accepted < stats.drafted
        assert stats.accepted_at[k - 1] > 0 and stats.accepted_at[0] < stats.rounds
    assert llm.engine.is_idle()


@pytest.mark.parametrize("params", [SAMPLED, PENALISED], ids=["top_p", "penalties"])
def test_seeded_sampling_equals_plain(composite_ckpt, params: SamplingParams) -> None:
    """Row j of a verification uses the RNG counter and penalty state of the j-th next token, so a
    seeded speculative run reproduces the plain run exactly, whatever is accepted."""
    plain = _load(composite_ckpt)
    want = _run(plain, _requests(plain, params, max_new=40))
    for drafter in ("oracle", "saboteur"):
        llm = _load(composite_ckpt, spec="mtp", draft_tokens=3)
        reqs = _requests(llm, params, max_new=40)
        _install(llm, reqs, want, None if drafter == "oracle" else itertools.cycle(range(4)))
        assert _run(llm, reqs) == want, drafter
        assert llm.engine.spec_totals.accepted > 0


def test_stop_inside_a_round_commits_up_to_the_stop(composite_ckpt) -> None:
    plain = _load(composite_ckpt)
    full = _run(plain, _requests(plain, GREEDY, max_new=40))
    stop = full[1][6]  # a token the oracle's accepted run passes mid-round
    want = _run(plain, _requests(plain, GREEDY, max_new=40, stop_token_ids=[stop]))
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=5)
    reqs = _requests(llm, GREEDY, max_new=40, stop_token_ids=[stop])
    _install(llm, reqs, full, None)
    got = llm._run(reqs)
    assert [c.token_ids for c in got] == want
    assert got[1].token_ids[-1] == stop and got[1].finish_reason == "stop"
    assert llm.engine.is_idle()


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_quantized_kv_and_chunked_prefill(composite_ckpt, kv_dtype: str) -> None:
    plain = _load(composite_ckpt, kv_dtype=kv_dtype, prefill_chunk=8)
    want = _run(plain, _requests(plain, GREEDY))
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=2, kv_dtype=kv_dtype, prefill_chunk=8)
    reqs = _requests(llm, GREEDY)
    _install(llm, reqs, want, itertools.cycle(range(3)))
    assert _run(llm, reqs) == want


def test_prefix_cache_hits_with_speculation(composite_ckpt) -> None:
    plain = _load(composite_ckpt, prefix_cache=False)
    want = _run(plain, _requests(plain, GREEDY))
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=3)
    first = _requests(llm, GREEDY)
    assert _run(llm, first) == want
    again = _requests(llm, GREEDY)
    assert _run(llm, again) == want
    assert sum(r.cached_tokens for r in again) > 0


def test_forced_acceptance_commits_exactly_n_plus_one_per_round(composite_ckpt) -> None:
    for n in range(4):
        llm = _load(composite_ckpt, spec="mtp", draft_tokens=3)
        force_acceptance(llm.engine.spec, n)
        reqs = _requests(llm, GREEDY, max_new=30)
        outs = _run(llm, reqs)
        for r, out in zip(reqs, outs):
            if r.finish_reason == "length":
                assert r.spec_stats.rounds == -(-(len(out) - 1) // (n + 1))
            assert r.spec_stats.accepted == n * r.spec_stats.rounds
        assert llm.engine.is_idle()


def test_pools_balance_after_thousands_of_rounds(composite_ckpt) -> None:
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=3, max_concurrency=4, max_context=1024,
                prefix_cache=False)
    engine = llm.engine
    free_pages, free_slots = engine.pages.num_free, engine.slots.num_free
    prompts = [[7 + i] * (3 + i) for i in range(24)]
    reqs = [llm._request(p, 150 + 50 * (i % 3), GREEDY) for i, p in enumerate(prompts)]
    llm._run(reqs)
    assert engine.spec_totals.rounds >= 2000
    assert engine.pages.num_free == free_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == free_slots
    assert engine.is_idle()


def test_cancel_mid_generation_frees_the_spare_slots(composite_ckpt) -> None:
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=4)
    engine = llm.engine
    req = llm._request(PROMPTS[0], 100, GREEDY)
    engine.add_request(req)
    while len(req.output_ids) < 5:
        engine.step()
    assert len(req.spare_slots) == 5
    engine.cancel(req.request_id)
    assert req.spare_slots == [] and engine.is_idle()


# ---------------------------------------------------------------- the MTP cache holds target-conditioned entries

def test_force_acceptance_checks_its_range_and_undoes(composite_ckpt) -> None:
    spec = _load(composite_ckpt, spec="mtp", draft_tokens=3).engine.spec
    sampled, drafts = torch.tensor([[1, 2, 9, 4], [7, 0, 0, 0]]), torch.tensor([[1, 2, 3], [1, 2, 3]])
    assert spec.acceptance(sampled, drafts).tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"0\.\.3"):
        force_acceptance(spec, 4)
    force_acceptance(spec, 3)
    assert spec.acceptance(sampled, drafts).tolist() == [3, 3]
    force_acceptance(spec, None)
    assert spec.acceptance(sampled, drafts).tolist() == [2, 0]


def _reference_mtp(llm, tokens: list[int], upto: int, extra_pages: int = 2):
    """Target hidden states of ``tokens[:upto]`` and an MTP cache filled from scratch with the true
    pairs (h_t, x_{t+1}) for t < upto (contiguous pages)."""
    from ninfer.models.batch import make_batch
    from ninfer.models.mtp import MTPCache

    llm.runner.start(upto)
    hidden = llm.runner.extend(tokens[:upto])
    head, ps = llm.engine.spec.head, llm.engine.config.page_size
    ref = MTPCache(llm.config, num_pages=-(-upto // ps) + extra_pages, page_size=ps, device="cpu", dtype=hidden.dtype)
    pairs = upto - 1
    if pairs > 0:
        batch = make_batch(
            input_ids=tokens[1:upto], positions=torch.arange(pairs), seq_lens=[pairs], context_lens=[pairs],
            block_tables=torch.arange(ref.num_pages, dtype=torch.int32)[None], slot_mapping=torch.arange(pairs),
            state_slots=[0])
        with torch.inference_mode():
            head(hidden[:pairs], torch.tensor(tokens[1:upto]), batch, ref)
    return hidden, ref


def _assert_mtp_kv_matches_reference(llm, req: Request, upto: int) -> None:
    """MTP K/V of positions ``0 .. upto - 1`` equal the head run over the true pairs (h_t, x_{t+1})."""
    _, ref = _reference_mtp(llm, req.tokens(0, upto + 1), upto + 1)
    ps = llm.engine.config.page_size
    cache = llm.engine.runner.cache
    kv = cache.kv[cache.mtp_layer]
    for name in ("k", "v"):
        got = torch.stack([getattr(kv, name)[req.pages[t // ps], t % ps] for t in range(upto)])
        want = getattr(ref.kv[0], name).flatten(0, 1)[:upto]
        assert (got - want).norm() <= 1e-4 * want.norm(), name


def _assert_drafts_match_reference(llm, req: Request, rounds: list[tuple[int, list[int]]], k: int) -> None:
    """The engine's batched drafts equal per-sequence :func:`draft` from a from-scratch MTP cache."""
    from ninfer.models.mtp import draft

    ps = llm.engine.config.page_size
    for n, got in rounds:
        tokens = req.tokens(0, n + 1)
        hidden, ref = _reference_mtp(llm, tokens, n, extra_pages=-(-k // ps) + 1)
        want = draft(llm.model, llm.engine.spec.head, hidden[n - 1], tokens[n], n - 1, k, cache=ref,
                     block_table=torch.arange(ref.num_pages, dtype=torch.int32), vocab_limit=llm.valid_vocab)
        assert got == want, n


@pytest.mark.parametrize("drafter", ["head", "oracle", "saboteur"])
def test_mtp_cache_after_chunked_prefill_and_rounds(composite_ckpt, drafter: str) -> None:
    """Chunked prefill writes the prompt's pairs; each round's catch-up rewrites the accepted pairs
    with the target's verification states (not the drafts' own), so entries before the last
    verification's start always equal a from-scratch MTP pass over the committed sequence."""
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=3, prefill_chunk=5, prefix_cache=False)
    plain = _load(composite_ckpt, prefix_cache=False)
    prompt = PROMPTS[1]
    want = _run(plain, [plain._request(list(prompt), 40, GREEDY)])
    engine = llm.engine
    req = llm._request(list(prompt), 40, GREEDY)
    if drafter != "head":
        _install(llm, [req], want, None if drafter == "oracle" else itertools.cycle(range(4)))
    inner, rounds = engine.spec.propose, []

    def record(lanes: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        rounds.append((int(n[0]), drafts[0].tolist()))
        return inner(lanes, n, drafts) if inner is not None else drafts

    engine.spec.propose = record
    engine.add_request(req)
    while not req.output_ids:
        engine.step()
    _assert_mtp_kv_matches_reference(llm, req, len(prompt) - 1)
    while len(req.output_ids) < 25:
        engine.step()
        start = int(engine.spec.start[req.lane])
        _assert_mtp_kv_matches_reference(llm, req, start)
    _assert_drafts_match_reference(llm, req, rounds[:8], 3)
    engine.cancel(req.request_id)


# ---------------------------------------------------------------- the acceptance rule keeps the target distribution

def _chi2_threshold(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square(df) at normal quantile ``z`` (Wilson-Hilferty; z = 3.09: p = 0.001)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3


def test_stochastic_acceptance_preserves_the_target_distribution() -> None:
    """A bigram "target" over 5 tokens, K = 2 drafts from a different (sometimes right) distribution:
    the first two committed tokens follow p(t1 | c) p(t2 | t1) (chi-square over all 25 pairs)."""
    from ninfer.runtime.sampler import Sampler
    from ninfer.runtime.speculative import accepted_drafts, committed_tokens

    vocab, lanes, trials, k = 5, 8, 4000, 2
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen) * 1.5  # target logits given the previous token
    draft_probs = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)
    sampler = Sampler(lanes, vocab, vocab, torch.device("cpu"))
    counts, naive = torch.zeros(vocab, vocab), torch.zeros(vocab, vocab)
    context = 2
    for first in range(0, trials, lanes):
        reqs = []
        for lane in range(lanes):
            req = Request(prompt_ids=[context], params=SamplingParams(temperature=1.0, seed=first + lane),
                          max_new_tokens=2)
            req.lane = lane
            sampler.start(req)
            reqs.append(req)
        out: list[list[int]] = [[] for _ in reqs]
        last = torch.full((lanes,), context)
        while any(len(o) < 2 for o in out):
            drafts = [last]
            for _ in range(k):
                drafts.append(torch.multinomial(draft_probs[drafts[-1]], 1, generator=gen)[:, 0])
            drafts_t = torch.stack(drafts[1:], 1)
            rows = torch.cat([last[:, None], drafts_t], 1)  # row j's context token
            draw = sampler.draw_rows(table[rows].reshape(-1, vocab), reqs, drafts_t)
            sampled = draw.out.token_ids.view(lanes, k + 1)
            accepted = accepted_drafts(sampled, drafts_t)
            committed = committed_tokens(sampled, drafts_t, accepted)
            sampler.commit(draw, accepted)
            if all(not o for o in out):  # a rule that trusted the drafts would emit d_1, d_2
                for b in range(lanes):
                    naive[drafts_t[b, 0], drafts_t[b, 1]] += 1
            for b in range(lanes):
                out[b].extend(committed[b, :int(accepted[b]) + 1].tolist())
                last[b] = out[b][-1]
        for o in out:
            counts[o[0], o[1]] += 1
    p1 = torch.softmax(table[context], -1)
    expected = (p1[:, None] * torch.softmax(table, -1)) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert counts.sum() == trials
    assert chi2 < _chi2_threshold(vocab * vocab - 1), chi2
    # The test has power: the same statistic rejects the drafts' own distribution.
    assert float(((naive - expected) ** 2 / expected).sum()) > 10 * _chi2_threshold(vocab * vocab - 1)


def test_logprobs_of_committed_tokens_equal_plain(composite_ckpt) -> None:
    """Each committed token reports the logprobs of its own verification row."""
    params = SamplingParams(greedy=True, logprobs=3)
    plain = _load(composite_ckpt)
    want = _requests(plain, params, max_new=20)
    outs = {r.request_id: [] for r in want}
    plain_ids = [r.request_id for r in want]
    for r in want:
        plain.engine.add_request(r)
    while plain.engine.has_work:
        for ev in plain.engine.step():
            outs[ev.request_id].extend(ev.logprobs or [])
    llm = _load(composite_ckpt, spec="mtp", draft_tokens=3)
    reqs = _requests(llm, params, max_new=20)
    _install(llm, reqs, [r.output_ids for r in want], itertools.cycle(range(4)))
    got = {r.request_id: [] for r in reqs}
    for r in reqs:
        llm.engine.add_request(r)
    while llm.engine.has_work:
        for ev in llm.engine.step():
            got[ev.request_id].extend(ev.logprobs or [])
    assert llm.engine.spec_totals.accepted > 0
    for pid, r in zip(plain_ids, reqs):
        a, b = outs[pid], got[r.request_id]
        assert [x[0] for x in a] == [x[0] for x in b] and len(a) == len(r.output_ids)
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b):
            assert abs(lp_a - lp_b) < 1e-4
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_round_inputs_are_aligned_views_of_one_block(composite_ckpt) -> None:
    """Lanes, state slots and per-token slots of every batch size: views of one block (one copy fills them), each
    16-byte aligned as a tensor of its own would be (the kernels specialise on pointer alignment)."""
    spec = _load(composite_ckpt, spec="mtp", draft_tokens=3).engine.spec
    for b, views in spec._views.items():
        assert [tuple(v.shape) for v in views] == [(b,), (b,), (b, 4)]
        assert all(v.data_ptr() % 16 == 0 and v.is_contiguous() for v in views), b
        assert all(v.untyped_storage().data_ptr() == spec._inputs.untyped_storage().data_ptr() for v in views)
