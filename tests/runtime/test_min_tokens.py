"""``min_tokens``: no stop (end-of-sequence id, stop_token_ids, stop string) ends a request before it has
that many tokens; other rows of the batch are unchanged; MTP speculation commits what plain decoding does.

Random tiny checkpoints rarely emit their end-of-sequence token, so each test picks as its stop the token
(or the text) that the unconstrained greedy run emits at index ``STOP_AT``: that run demonstrably ends
early, so a longer constrained run proves the suppression.
"""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels.sampling import suppress_tokens
from ninfer.runtime.stops import StopStringMatcher

PROMPT = [5, 17, 33, 99, 12, 7, 201, 45]
OTHERS = [list(range(20, 57)), [300, 301, 302]]
STOP_AT = 2
MIN = 10
MAX = 24


def _greedy(**kw) -> ninfer.SamplingParams:
    return ninfer.SamplingParams(temperature=0, max_tokens=MAX, **kw)


def _first_new(tokens: list[int]) -> int:
    """An index >= STOP_AT whose token is not among the earlier ones (so the run stops exactly there)."""
    return next(i for i in range(STOP_AT, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", progress=False, max_concurrency=3, max_context=512)


@pytest.fixture(scope="module")
def free_run(llm) -> list[int]:
    """The unconstrained greedy tokens of PROMPT (no stop among them: the tiny model's EOS never comes)."""
    out = llm.generate([PROMPT], _greedy(ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == MAX
    return out.token_ids


def _run(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params)[0].outputs[0]


def test_stop_token_ids_wait_for_min_tokens(llm, free_run) -> None:
    i = _first_new(free_run)
    stop = free_run[i]
    early = _run(llm, _greedy(stop_token_ids=[stop]))
    assert early.token_ids == free_run[:i + 1] and early.finish_reason == "stop"
    out = _run(llm, _greedy(stop_token_ids=[stop], min_tokens=MIN))
    assert len(out.token_ids) > MIN and stop not in out.token_ids[:MIN]
    assert out.token_ids[:i] == free_run[:i]  # nothing changes before the masked step
    if out.finish_reason == "stop":  # the stop may come, but only after the minimum
        assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == MAX


def test_end_of_sequence_ids_wait_for_min_tokens(llm, free_run, monkeypatch) -> None:
    i = _first_new(free_run)
    # Make the model's end-of-sequence set the token the free run emits at i: the path of a real EOS
    # (LLM.stop_ids -> the output processor -> the sampler's mask), with a token this model does emit.
    monkeypatch.setattr(llm, "stop_ids", frozenset({free_run[i]}))
    early = _run(llm, _greedy())
    assert early.token_ids == free_run[:i + 1] and early.finish_reason == "stop"
    out = _run(llm, _greedy(min_tokens=MIN))
    assert len(out.token_ids) > MIN and free_run[i] not in out.token_ids[:MIN]
    # ignore_eos takes the EOS ids out of the stop set, so min_tokens then masks nothing.
    assert _run(llm, _greedy(min_tokens=MIN, ignore_eos=True)).token_ids == free_run


def _piece(llm, tokens: list[int], a: int, b: int) -> str:
    """The text tokens ``a .. b-1`` add to the decoded output."""
    return llm.tokenizer.decode(tokens[:b])[len(llm.tokenizer.decode(tokens[:a])):]


def test_stop_strings_do_not_match_before_min_tokens(llm, free_run) -> None:
    text = llm.tokenizer.decode(free_run)
    i = _first_new(free_run)
    early_stop = _piece(llm, free_run, i, i + 1)
    assert early_stop
    early = _run(llm, _greedy(stop=[early_stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) <= i + 1 and early.stop_reason == early_stop
    # A stop string begun by token MIN - 1 (before the minimum) and completed by token MIN (the first that
    # may end the request) counts, as in vLLM, whose check covers stop strings ending in the new text.
    span = _piece(llm, free_run, MIN - 1, MIN + 1)
    out = _run(llm, _greedy(stop=[early_stop, span], min_tokens=MIN))
    head = llm.tokenizer.decode(free_run[:MIN])
    assert early_stop in head  # the early stop string was passed over
    # The oracle: the first occurrence of either stop string that ends after the first MIN tokens' text.
    end, neg, matched = min((j + len(s), -len(s), s) for s in (early_stop, span) for j in range(len(text))
                            if text.startswith(s, j) and j + len(s) > len(head))
    assert out.finish_reason == "stop" and out.stop_reason == matched and out.text == text[:end + neg]
    assert out.token_ids == free_run[:len(out.token_ids)] and len(out.token_ids) > MIN


def test_mixed_batch_leaves_the_other_rows_unchanged(llm, free_run) -> None:
    stop = free_run[_first_new(free_run)]
    alone = [_run(llm, _greedy(stop_token_ids=[stop]), p).token_ids for p in OTHERS]
    seeded = ninfer.SamplingParams(temperature=1.0, seed=3, max_tokens=MAX, stop_token_ids=[stop])
    alone_sampled = _run(llm, seeded, OTHERS[0]).token_ids
    with_min = _run(llm, _greedy(stop_token_ids=[stop], min_tokens=MIN)).token_ids
    outs = llm.generate([PROMPT, *OTHERS, OTHERS[0]],
                        [_greedy(stop_token_ids=[stop], min_tokens=MIN), _greedy(stop_token_ids=[stop]),
                         _greedy(stop_token_ids=[stop]), seeded])
    assert [o.outputs[0].token_ids for o in outs] == [with_min, *alone, alone_sampled]


def test_n_samples_and_sampling_respect_min_tokens(llm, free_run) -> None:
    stop = free_run[_first_new(free_run)]
    params = ninfer.SamplingParams(temperature=1.5, seed=11, n=4, max_tokens=MAX, min_tokens=MIN,
                                   stop_token_ids=[stop, *free_run[:STOP_AT]])
    for sample in llm.generate([PROMPT], params)[0].outputs:
        assert len(sample.token_ids) > MIN
        assert not set(sample.token_ids[:MIN]) & {stop, *free_run[:STOP_AT]}


def test_min_tokens_validation() -> None:
    assert ninfer.SamplingParams(min_tokens=16).min_tokens == 16
    assert ninfer.SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match="min_tokens"):
            ninfer.SamplingParams(min_tokens=bad)


def test_keyword_api_takes_min_tokens(llm, free_run) -> None:
    stop = free_run[_first_new(free_run)]
    out = llm.generate(PROMPT, max_new_tokens=MAX, greedy=True, stop_token_ids=[stop], min_tokens=MIN)
    assert len(out.token_ids) > MIN


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafter", ["real", "free_run"])
def test_mtp_greedy_with_min_tokens_equals_plain(composite_ckpt, k: int, drafter: str) -> None:
    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512)
    plain = ninfer.load(composite_ckpt.path, **kw)
    free = _run(plain, _greedy(ignore_eos=True)).token_ids
    stop = free[_first_new(free)]
    params = [_greedy(stop_token_ids=[stop], min_tokens=MIN), _greedy(stop_token_ids=[stop]),
              _greedy(stop_token_ids=[stop], min_tokens=3)]
    prompts = [PROMPT, *OTHERS]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert len(want[0]) > MIN
    spec = ninfer.load(composite_ckpt.path, spec="mtp", draft_tokens=k, **kw)
    if drafter == "free_run":
        # Draft the unconstrained continuation of PROMPT, whose stop token comes before MIN: every such
        # draft must be rejected, as the target's row cannot sample it.
        full = PROMPT + free

        def propose(lanes: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
            out = drafts.clone()
            for b, pos in enumerate(n.tolist()):
                for j in range(drafts.shape[1]):
                    out[b, j] = full[pos + 1 + j] if pos + 1 + j < len(full) else stop
            return out

        spec.engine.spec.propose = propose
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.spec_totals.rounds > 0
    if drafter == "free_run":
        assert spec.engine.spec_totals.accepted > 0  # the drafter was consulted


def test_suppress_tokens_masks_only_the_named_pairs() -> None:
    logits = torch.randn(4, 10)
    before = logits.clone()
    suppress_tokens(logits, torch.tensor([1, 3]), torch.tensor([0, 0, 1]), torch.tensor([2, 5, 7]), vocab_limit=9)
    want = before.clone()
    want[1, 2] = want[1, 5] = want[3, 7] = float("-inf")
    assert torch.equal(logits, want)


def test_suppress_tokens_keeps_a_row_that_could_only_end() -> None:
    logits = torch.full((2, 6), float("-inf"))
    logits[0, 3] = 1.0  # a grammar that allows only the stop id 3
    logits[0, 5] = 2.0  # vocabulary padding (>= vocab_limit) does not count as something else to draw
    logits[1, 3], logits[1, 1] = 1.0, 0.5
    suppress_tokens(logits, torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([3, 3]), vocab_limit=5)
    assert logits[0, 3] == 1.0 and logits[1, 3] == float("-inf") and logits[1, 1] == 0.5


@pytest.mark.parametrize("pieces", [["ab", "cab", "c"], ["a", "b", "c", "a", "b", "c"], ["abcab", "c"]])
def test_unarmed_matcher_passes_hits_and_matches_after(pieces: list[str]) -> None:
    """Stops "abc" and "cab": hits in unarmed deltas pass (text kept); a match completed armed stops, even one
    that an unarmed delta began."""
    text = "".join(pieces)
    for armed_from in range(len(pieces) + 1):
        m = StopStringMatcher(["abc", "cab"])
        out = []
        for n, piece in enumerate(pieces):
            emitted, hit = m.feed(piece, armed=n >= armed_from)
            out.append(emitted)
            if hit:
                break
        if not m.stopped:
            out.append(m.flush())
        got = "".join(out)
        # The oracle: the first stop occurrence that ends inside an armed piece.
        start = sum(len(p) for p in pieces[:armed_from])
        hits = sorted((j + len(s), -len(s), s) for s in ("abc", "cab") for j in range(len(text))
                      if text.startswith(s, j) and j + len(s) > start)
        if hits:
            end, neg, s = hits[0]
            assert m.matched == s and got == text[:end + neg], (armed_from, got)
        else:
            assert not m.stopped and got == text, (armed_from, got)


def test_structured_output_ends_where_the_grammar_must(llm) -> None:
    """A grammar that can only end ends (the stop id is all it allows: the row keeps it), before min_tokens; one
    that may go on is held open until min_tokens, and still conforms."""
    pytest.importorskip("xgrammar")
    from ninfer.runtime.structured import Constraint

    def run(constraint, **kw):
        return _run(llm, _greedy(structured=constraint, **kw))

    done = run(Constraint.choice(["yes"]), min_tokens=MIN)
    assert done.text == "yes" and done.finish_reason == "stop" and len(done.token_ids) < MIN
    assert done.token_ids[-1] in llm.stop_ids
    free = run(Constraint.regex("(ab)+"))
    held = run(Constraint.regex("(ab)+"), min_tokens=MIN)
    assert len(free.token_ids) < MIN  # without the minimum the grammar lets this model end early
    assert len(held.token_ids) > MIN and held.finish_reason in ("stop", "length")
    assert held.text.startswith("ab") and set(held.text.replace("ab", "")) == set()


def _feed_all(stops: list[str], pieces: list[str], armed_from: int) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out = []
    for n, piece in enumerate(pieces):
        emitted, hit = m.feed(piece, armed=n >= armed_from)
        out.append(emitted)
        if hit:
            return "".join(out), m.matched
    return "".join(out) + m.flush(), None


def _oracle(stops: list[str], pieces: list[str], armed_from: int) -> tuple[str, str | None]:
    """The first occurrence (ending first, then longest) that ends inside an armed piece; the text before it."""
    text, start = "".join(pieces), sum(len(p) for p in pieces[:armed_from])
    hits = sorted((j + len(s), -len(s), s) for s in set(stops) for j in range(len(text))
                  if text.startswith(s, j) and j + len(s) > start)
    if not hits:
        return text, None
    end, neg, s = hits[0]
    return text[:end + neg], s


def test_unarmed_matcher_matches_the_oracle_on_random_streams() -> None:
    """Periodic stop strings ("aa", "abab", "aba") exercise the KMP continuation after a passed-over hit."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 16)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        armed_from = rng.randint(0, len(pieces))
        assert _feed_all(stops, pieces, armed_from) == _oracle(stops, pieces, armed_from), (stops, pieces, armed_from)
