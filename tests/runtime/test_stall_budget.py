"""``max_decode_stall``: the prompt tokens of a step beside decodes follow from measured step times
(:mod:`ninfer.runtime.stall_budget`), so such a step stays within the bound."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.runtime.options import OptionError
from ninfer.runtime.stall_budget import GRAPH_AFTER_MISS, LEAST_TOKENS, StallBound, StallBudget
from tiny_checkpoints import TinyCheckpoint


def test_bounds_parse_and_bad_ones_say_what_is_accepted() -> None:
    assert StallBound.parse("40ms") == StallBound(seconds=0.04)
    assert StallBound.parse(" 2.5x ") == StallBound(factor=2.5)
    assert StallBound.parse("3x").limit(0.01) == pytest.approx(0.03)
    assert StallBound.parse("40ms").limit(0.01) == pytest.approx(0.04)
    for bad in ("40", "3", "x", "1x", "0.5x", "0ms", "-5ms", "fast", ""):
        with pytest.raises(ValueError, match="got"):
            StallBound.parse(bad)


def _simulate(budget: StallBudget, decode_s: float, token_s: float, steps: int) -> list[int]:
    """Steps of a model whose step beside decodes costs ``decode_s + tokens * token_s``: the budgets used."""
    for _ in range(3):
        budget.observe(decode_s, 0, 4)
    used = []
    for _ in range(steps):
        n = budget.tokens()
        used.append(n)
        budget.observe(decode_s + n * token_s, n, 4)
    return used


def test_the_budget_brings_a_mixed_step_to_the_bound() -> None:
    """The first step beside decodes takes the fixed first guess; from the second the step's time sits at the
    bound, whether relative to the decode step or absolute; a dearer prompt token gets fewer tokens."""
    used = _simulate(StallBudget(StallBound.parse("3x"), initial=1024, most=8192), decode_s=0.0073,
                     token_s=0.00015, steps=6)
    assert used[0] == 1024
    assert all(0.0073 + n * 0.00015 <= 3 * 0.0073 + 1e-9 for n in used[1:])
    assert used[-1] == int((3 * 0.0073 - 0.0073) / 0.00015)
    dear = _simulate(StallBudget(StallBound.parse("40ms"), initial=1024, most=8192), decode_s=0.0073,
                     token_s=0.0003, steps=40)
    assert dear[-1] == pytest.approx((0.04 - 0.0073) / 0.0003, abs=1)


def test_the_budget_stays_between_its_floor_and_the_chunk() -> None:
    tight = _simulate(StallBudget(StallBound.parse("1.01x"), initial=512, most=8192), 0.01, 0.001, 5)
    assert tight[1:] == [LEAST_TOKENS] * 4  # some progress on the prompt whatever the bound
    loose = _simulate(StallBudget(StallBound.parse("1000ms"), initial=512, most=2048), 0.01, 0.00001, 5)
    assert loose[1:] == [2048] * 4
    assert StallBudget(StallBound.parse("3x"), initial=9000, most=2048).tokens() == 2048


def test_a_chunk_graph_raises_the_floor_to_its_length() -> None:
    """Chunks shorter than the prompt-chunk graph's run eagerly, dearer than the graph's whole step: a tight bound
    settles at the graph's length instead of LEAST_TOKENS (never past the prefill chunk)."""
    budget = StallBudget(StallBound.parse("1.01x"), initial=128, most=8192)
    budget.replays_chunks_of(128)
    assert _simulate(budget, 0.01, 0.001, 5) == [128] * 5
    loose = StallBudget(StallBound.parse("1000ms"), initial=128, most=2048)
    loose.replays_chunks_of(128)
    assert _simulate(loose, 0.01, 0.00001, 3)[1:] == [2048] * 2
    small = StallBudget(StallBound.parse("3x"), initial=64, most=100)
    small.replays_chunks_of(256)
    assert small.least == 100


def _simulate_graph(bound: str, graph: int, steps: int) -> list[tuple[int, float]]:
    """The 27B int4 on the H200 beside 4 decodes (run 2026-12-04.22): an 8.5 ms decode step, a replayed
    ``graph``-token chunk adds 12.5 ms, an eager chunk of n tokens 100 ms + 0.15 ms a token. (budget, step s)."""
    budget = StallBudget(StallBound.parse(bound), initial=graph, most=8192)
    budget.replays_chunks_of(graph)
    for _ in range(3):
        budget.observe(0.0085, 0, 4)
    out = []
    for _ in range(steps):
        n = budget.tokens()
        seconds = 0.0085 + (0.0125 if n == graph else 0.1 + 0.00015 * n)
        out.append((n, seconds))
        budget.observe(seconds, n, 4)
    return out


def test_beside_a_chunk_graph_eager_steps_are_costed_apart() -> None:
    """Eager chunks cost a fixed ~100 ms whatever their length, a replayed one 12.5 ms for its 16 tokens. A bound
    the graph meets (3x) keeps every step at the graph's length (one cost per token over both kinds kept trying a
    few tokens more, each an eager step 5x over the bound), also for a graph shorter than LEAST_TOKENS; a bound
    eager steps cannot meet (100 ms) is exceeded once per GRAPH_AFTER_MISS steps; a loose one (1 s) grows the
    chunks to it."""
    tight = _simulate_graph("3x", 16, 40)
    assert {n for n, _ in tight} == {16} and max(s for _, s in tight) <= 3 * 0.0085
    mid = _simulate_graph("100ms", 16, GRAPH_AFTER_MISS + 10)
    assert [s > 0.1 for _, s in mid].count(True) == 2 and [n for n, _ in mid[-7:]] == [16] * 7
    loose = _simulate_graph("1000ms", 16, 40)
    assert loose[-1][0] > 1000 and all(s <= 1.0 + 1e-9 for _, s in loose[2:])
    budget = StallBudget(StallBound.parse("1000ms"), initial=16, most=8192)
    budget.replays_chunks_of(16)
    budget.observe(0.0085, 0, 4)
    budget.observe(0.0085 + 0.0125, 16, 4)
    budget.observe(0.0085 + 0.1, 3, 4)  # a prompt's eager 3-token tail says nothing about eager chunks
    assert budget.token_s is None and budget.tokens() > 1000


def test_steps_without_decodes_say_nothing() -> None:
    budget = StallBudget(StallBound.parse("3x"), initial=700, most=8192)
    budget.observe(0.5, 8192, 0)  # a prefill with nothing decoding stalls nobody
    budget.observe(0.02, 100, 4)  # beside decodes, but the decode step is not known yet
    assert budget.tokens() == 700 and budget.token_s is None


def test_the_option_is_checked_and_named(dense_ckpt: TinyCheckpoint) -> None:
    with pytest.raises(OptionError, match="max_decode_stall must be milliseconds"):
        ninfer.load(dense_ckpt.path, device="cpu", max_decode_stall="fast", progress=False)


def test_the_engine_reports_each_step_and_plans_with_the_budget(dense_ckpt: TinyCheckpoint) -> None:
    """Through the engine: every step reports its prompt tokens and decoding sequences; a long prompt beside
    decodes prefills in chunks of the budget the measured times give (here, forced dear), and its output is
    the one it has alone."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, max_decode_stall="3x",
                      prefill_tokens_while_decoding=64, progress=False)
    engine = llm.engine
    stall = engine.scheduler.stall
    assert stall is not None and stall.initial == 64
    seen = []
    observe = stall.observe
    stall.observe = lambda seconds, tokens, rows: seen.append((tokens, rows)) or observe(seconds, tokens, rows)
    params = llm.sampling_params(greedy=True)
    decoder = llm._request(list(range(5, 25)), 60, params)
    engine.add_request(decoder)
    while not decoder.output_ids:
        engine.step()
    for _ in range(3):
        engine.step()
    stall.decode_s, stall.token_s = 1 / 128, 3 / 8192  # (3 - 1) x 7.8 ms / 0.37 ms: 42.7 tokens a step
    budgets = []
    tokens = stall.tokens
    stall.tokens = lambda: budgets.append(tokens()) or budgets[-1]
    long = llm._request(list(range(30, 330)), 2, params)
    engine.add_request(long)
    start = len(seen)
    while not long.output_ids:
        engine.step()
    chunks = [n for n, rows in seen[start:] if rows == 1]
    assert seen[0] == (20, 0) and (0, 1) in seen[:start]
    assert budgets[0] == 42 and sum(chunks) == 300  # from then on, budgets follow this machine's step times
    assert chunks == [min(b, 300 - sum(chunks[:i])) for i, b in enumerate(budgets[:len(chunks)])]
    engine.run_until_done()
    alone = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=False)
    assert long.output_ids == alone._run([alone._request(list(range(30, 330)), 2, params)])[0].token_ids
