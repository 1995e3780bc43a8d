"""Structured output in the engine: whatever the random tiny model would write, the answer conforms.

Every finished ("stop") output is checked against its constraint with an independent checker
(``json`` + ``jsonschema``, ``re``); every output, finished or cut at ``max_tokens``, is replayed
token by token through a fresh xgrammar matcher, which must accept it.
"""
from __future__ import annotations

import itertools
import json
import re
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ninfer  # noqa: E402
from ninfer.runtime.request import Request  # noqa: E402
from ninfer.runtime.sampling import SamplingParams  # noqa: E402
from ninfer.runtime.structured import (Constraint, StructuredError,  # noqa: E402
                                       StructuredUnavailable, fill_bitmask, mask_logits)

PROMPTS = [[5, 17, 33, 99, 12, 7], [300, 301, 302], list(range(20, 31)), [77, 78]]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, progress=False)


def _run(llm, specs: list[tuple[Constraint | None, SamplingParams]], max_new: int) -> list[tuple[list[int], str]]:
    """One batch: request i runs ``specs[i]`` on prompt i; ``(token_ids, finish_reason)`` each."""
    reqs = [llm._request(PROMPTS[i % len(PROMPTS)], max_new, _with(params, c)) for i, (c, params) in enumerate(specs)]
    return [(c.token_ids, c.finish_reason) for c in llm._run(reqs)]


def _with(params: SamplingParams, c: Constraint | None) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, structured=c)


def _replay(llm, c: Constraint, tokens: list[int], reason: str) -> None:
    """A fresh matcher accepts every token; a "stop" output ends exactly where the grammar terminates."""
    matcher = xgr.GrammarMatcher(llm.structured.compile(c))
    for tok in tokens:
        assert matcher.accept_token(tok), (c, tokens)
    assert matcher.is_terminated() == (reason == "stop"), (c, tokens, reason)


def _answer(llm, tokens: list[int]) -> str:
    return llm.tokenizer.decode([t for t in tokens if t not in llm.stop_ids])


# -- schemas a property test draws -------------------------------------------------------------------
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.builds(lambda lo, ex: {"type": "number", "minimum": lo, **({"exclusiveMaximum": lo + 10} if ex else {})},
              st.integers(-5, 5), st.booleans()),
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 2), st.integers(0, 3)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["a", "b", 3, None, True, "x y"]),
                                                      min_size=1, max_size=3, unique=True)),
    st.builds(lambda v: {"const": v}, st.sampled_from(["k", 0, False])),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, required_mask: list[bool]) -> dict:
        names = list(props)
        required = [n for n, keep in zip(names, required_mask) if keep]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    props = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3)
    return props.flatmap(lambda p: st.lists(st.booleans(), min_size=len(p), max_size=len(p)).map(
        lambda mask: build(p, mask)))


SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        _object(inner),
        st.builds(lambda item, lo, span: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + span},
                  inner, st.integers(0, 1), st.integers(0, 2)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=5,
)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_json_schema_outputs_validate(llm, schema: dict) -> None:
    """A mixed batch: greedy and sampled constrained rows beside a free one; every answer conforms."""
    c = Constraint.json_schema(schema)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    specs = [(c, GREEDY), (c, sampled), (None, sampled), (c, SamplingParams(temperature=1.5, top_k=50, seed=5))]
    results = _run(llm, specs, max_new=40)
    for (spec, _), (tokens, reason) in zip(specs, results):
        if spec is None:
            continue
        _replay(llm, c, tokens, reason)
        if reason == "stop":
            jsonschema.validate(json.loads(_answer(llm, tokens)), schema)
        else:
            assert reason == "length" and len(tokens) == 40


def test_bounded_schema_finishes_and_validates(llm) -> None:
    """A schema whose every answer is short must end through the grammar, batch 1 and batched."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                               "tag": {"type": "string", "maxLength": 2}},
              "required": ["ok", "n", "tag"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    for specs in ([(c, GREEDY)], [(c, GREEDY), (None, GREEDY), (c, SamplingParams(temperature=1.0, seed=3))]):
        for (spec, _), (tokens, reason) in zip(specs, _run(llm, specs, max_new=40)):
            if spec is not None:
                assert reason == "stop"
                assert tokens[-1] in llm.stop_ids
                jsonschema.validate(json.loads(_answer(llm, tokens)), schema)


def test_free_rows_beside_constrained_ones_are_unchanged(llm) -> None:
    free = _run(llm, [(None, GREEDY), (None, SamplingParams(temperature=1.0, seed=9))], max_new=12)
    mixed = _run(llm, [(None, GREEDY), (None, SamplingParams(temperature=1.0, seed=9)),
                       (Constraint.regex("[0-9]+"), GREEDY)], max_new=12)
    assert mixed[:2] == free


def test_max_tokens_before_the_grammar_completes_is_length(llm) -> None:
    c = Constraint.json_schema({"type": "object", "properties": {"s": {"type": "string", "minLength": 30}},
                                "required": ["s"]})
    [(tokens, reason)] = _run(llm, [(c, GREEDY)], max_new=3)
    assert reason == "length" and len(tokens) == 3
    _replay(llm, c, tokens, reason)


@pytest.mark.parametrize("c, check", [
    (Constraint.regex(r"[a-c]{2,4}-\d\d"), lambda s: re.fullmatch(r"[a-c]{2,4}-\d\d", s)),
    (Constraint.choice(["yes", "no", 'say "hi"\n', "ünï"]), lambda s: s in ("yes", "no", 'say "hi"\n', "ünï")),
    (Constraint.grammar('root ::= "(" item ("," item)* ")"\nitem ::= [a-z] | "[" [0-9] "]"'),
     lambda s: re.fullmatch(r"\((?:[a-z]|\[[0-9]\])(?:,(?:[a-z]|\[[0-9]\]))*\)", s)),
    (Constraint.json_object(), lambda s: isinstance(json.loads(s), dict)),
])
def test_regex_choice_grammar_outputs_match(llm, c: Constraint, check) -> None:
    specs = [(c, GREEDY), (c, SamplingParams(temperature=1.0, seed=21)), (c, SamplingParams(temperature=0.7, seed=4))]
    finished = 0
    for tokens, reason in _run(llm, specs, max_new=24):
        _replay(llm, c, tokens, reason)
        if reason == "stop":
            finished += 1
            assert check(_answer(llm, tokens)), _answer(llm, tokens)
    if c.kind in ("regex", "choice"):  # both bound the answer's length well under 24 tokens
        assert finished == len(specs)


def test_thinking_is_free_and_the_constraint_starts_after_think_end(llm) -> None:
    state = llm.structured.state(Constraint.choice(["ok"]), thinking=True)
    think_end = llm.tokenizer.token_id("</think>")
    bitmask = torch.full((3, 16), -1, dtype=torch.int32)
    assert state.fill_rows(bitmask, 0, [7, think_end]) == [False, False, True]
    assert not state.active  # the tentative drafts left the state as it was
    for tok in (7, 9, think_end):
        state.accept(tok)
    assert state.active
    assert state.fill_rows(bitmask, 0) == [True]
    allowed = [t for t in range(512) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(llm.tokenizer.decode([t]) in ("o", "ok") for t in allowed)


def test_chat_with_thinking_constrains_only_the_answer(llm) -> None:
    schema = {"type": "object", "properties": {"v": {"enum": ["x", "y"]}}, "required": ["v"],
              "additionalProperties": False}
    for seed in range(3):
        out = llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=48, seed=seed,
                       structured=Constraint.json_schema(schema))
        if out.finish_reason == "stop" and out.text:
            assert json.loads(out.text) in ({"v": "x"}, {"v": "y"})


def test_draft_rows_match_sequential_masks(llm) -> None:
    c = Constraint.grammar('root ::= [a-z]+ "." [0-9]')
    tok = llm.tokenizer
    drafts = [tok.token_id(t) for t in ("a", "b", ".", "3")]
    assert None not in drafts
    state = llm.structured.state(c)
    rows = torch.full((5, 16), -1, dtype=torch.int32)
    assert state.fill_rows(rows, 0, drafts) == [True] * 5
    ref = xgr.GrammarMatcher(llm.structured.compile(c))
    want = torch.full((5, 16), -1, dtype=torch.int32)
    for j in range(5):
        if not ref.is_terminated():
            ref.fill_next_token_bitmask(want, j)
        if j < 4:
            assert ref.accept_token(drafts[j])
    assert torch.equal(rows[:4], want[:4])
    bad = [drafts[0], tok.token_id("."), tok.token_id(".")]  # the third token breaks the grammar
    assert state.fill_rows(torch.full((4, 16), -1, dtype=torch.int32), 0, bad) == [True, True, True, False]
    state.accept(drafts[0])  # the matcher was rolled back: it starts from the beginning again


def test_mask_logits_matches_xgrammar(llm) -> None:
    c = Constraint.regex("[0-9]{2}")
    reqs = [Request([1], GREEDY, 4), Request([1], GREEDY, 4)]
    reqs[1].grammar = llm.structured.state(c)
    logits = torch.randn(2, 512)
    want = logits.clone()
    mask_logits(logits, reqs)
    assert torch.equal(logits[0], want[0])  # the free row is untouched
    bitmask = xgr.allocate_token_bitmask(1, 512)
    xgr.GrammarMatcher(llm.structured.compile(c)).fill_next_token_bitmask(bitmask, 0)
    ref = want[1:].clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    assert torch.equal(logits[1:], ref)


@pytest.mark.parametrize("make, param, words", [
    (lambda: Constraint.regex("a(", param="guided_regex"), "guided_regex", "regular expression"),
    (lambda: Constraint.grammar('root ::= "a" |', param="guided_grammar"), "guided_grammar", "grammar"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 2}, param="schema"), "schema",
     "minimum"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},
                                    param="schema"), "schema", "cannot be compiled"),
])
def test_bad_constraints_name_their_field(llm, make, param: str, words: str) -> None:
    with pytest.raises(StructuredError) as err:
        llm.structured.compile(make())
    assert err.value.param == param and words in str(err.value)


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "not": {"const": "a"}}, "s.not"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "s.properties.a.uniqueItems"),
    ({"type": "integer", "multipleOf": 3}, "s.multipleOf"),
    ({"type": "string", "format": "credit-card"}, "s.format"),
    ({"anyOf": [{"type": "string"}, {"if": {}}]}, "s.anyOf[1].if"),
    ({"type": "strin"}, "s.type"),
])
def test_unsupported_schema_features_are_reported(schema: dict, where: str) -> None:
    with pytest.raises(StructuredError) as err:
        Constraint.json_schema(schema, param="s")
    assert err.value.param == "s" and f"'{where}'" in str(err.value)


def test_without_xgrammar_a_constraint_is_a_clear_error(llm, monkeypatch) -> None:
    from ninfer.runtime.structured import StructuredCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    fresh = StructuredCompiler(llm.tokenizer.hf, 512, sorted(llm.stop_ids), None)
    with pytest.raises(StructuredUnavailable, match=r"pip install ninfer\[structured\]"):
        fresh.state(Constraint.json_object())
    assert llm.generate("hi", max_new_tokens=2).text is not None  # unconstrained requests still run


def test_speculative_structured_equals_plain(composite_ckpt) -> None:
    """Verification rows are masked along the draft: a seeded speculative run commits exactly the
    tokens of the plain constrained run, with drafts that follow it and drafts the grammar forbids."""
    c = Constraint.grammar('root ::= [a-e]+ ("," [0-9])* "."')
    params = SamplingParams(temperature=1.0, seed=7, structured=c)

    def load(**kw) -> ninfer.LLM:
        return ninfer.load(composite_ckpt.path, device="cpu", progress=False, max_concurrency=3, max_context=512,
                           **kw)

    def requests(llm) -> list[Request]:
        return [llm._request(list(p), 16, params) for p in PROMPTS[:3]]

    plain = load()
    want = [out.token_ids for out in plain._run(requests(plain))]
    for cut in (None, itertools.cycle(range(3))):
        llm = load(spec="mtp", draft_tokens=3)
        reqs = requests(llm)
        full = {r.request_id: r.prompt_ids + out for r, out in zip(reqs, want)}

        def propose(lanes, n, drafts, full=full, reqs=reqs, cut=cut):
            by_lane = {r.lane: full[r.request_id] for r in reqs if r.lane is not None}
            out = drafts.clone()
            for b, (lane, pos) in enumerate(zip(lanes.tolist(), n.tolist())):
                seq, good = by_lane[lane], next(cut) if cut is not None else drafts.shape[1]
                for i in range(drafts.shape[1]):
                    truth = seq[pos + 1 + i] if pos + 1 + i < len(seq) else 0
                    out[b, i] = truth if i < good else (truth + 1 + i) % llm.valid_vocab
            return out
        llm.engine.spec.propose = propose
        assert [out.token_ids for out in llm._run(reqs)] == want
        assert llm.engine.spec_totals.accepted > 0
    for tokens in want:
        _replay(plain, c, tokens, "stop" if tokens[-1] in plain.stop_ids else "length")


def test_fill_bitmask_packs_constrained_rows_first(llm) -> None:
    """Constrained requests take consecutive bitmask rows from 0 (only those are copied to the device);
    free rows get -1 and cost nothing; the rows are xgrammar's."""
    c = Constraint.regex("[0-9]{2}")
    reqs = [Request([1], GREEDY, 4) for _ in range(4)]
    reqs[1].grammar, reqs[3].grammar = llm.structured.state(c), llm.structured.state(Constraint.regex("a+"))
    bitmask = torch.zeros(6, 16, dtype=torch.int32)
    mask_rows = torch.zeros(4, dtype=torch.int32)
    assert fill_bitmask(bitmask, mask_rows, reqs) == 2
    assert mask_rows.tolist() == [-1, 0, -1, 1]
    for row, cons in ((0, c), (1, Constraint.regex("a+"))):
        want = xgr.allocate_token_bitmask(1, 512)
        xgr.GrammarMatcher(llm.structured.compile(cons)).fill_next_token_bitmask(want, 0)
        assert torch.equal(bitmask[row], want[0])
    assert bool((bitmask[2:] == 0).all())  # rows past the constrained ones are not written
    sampler = llm.engine.sampler
    assert sampler._token_mask(reqs[::2], 1, None) is None  # a free batch does no mask work
    got_mask, got_rows = sampler._token_mask(reqs, 1, None)
    assert got_rows.tolist() == [-1, 0, -1, 1] and torch.equal(got_mask[:2], bitmask[:2])


def test_accepted_tokens_apply_at_the_next_fill(llm) -> None:
    # accept() only queues (xgrammar's accept_token would sit between a step's tokens and the next forward);
    # the fill that follows applies them, and a token the grammar forbids is reported there.
    tok = llm.tokenizer
    state = llm.structured.state(Constraint.grammar('root ::= [a-z]+ "." [0-9]'))
    rows = torch.full((1, 16), -1, dtype=torch.int32)
    state.accept(tok.token_id("a"))
    state.accept(tok.token_id("."))
    assert state.fill_rows(rows, 0) == [True]
    allowed = [t for t in range(512) if (int(rows[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)
    state.accept(tok.token_id("."))  # forbidden after "a."
    for _ in range(2):  # and again: the batch's rows are then sampled one by one, and this one must fail alone
        with pytest.raises(RuntimeError, match="does not allow"):
            state.fill_rows(rows, 0)
