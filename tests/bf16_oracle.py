"""When two runs of one request may differ by bf16 rounding only, and how a test checks that.

A request decoded alone and the same request batched with others (or verified K+1 tokens at a time by
MTP) run through GEMMs of different widths, which round bf16 differently; on tiny random models, whose
top tokens are often near ties, greedy and seeded sampling then diverge after some tokens. No engine
promises bit-identical bf16 outputs across batch shapes (fp32 runs keep the exact comparison). What a
test can still assert is that both runs computed the same distributions: along their common prefix
the chosen tokens' raw logprobs agree within rounding, and where they part, the batched run's token is
one the lone run also rated (for greedy: a near tie with the lone run's top token). A neighbour's
grammar mask or stop suppression leaking into a row breaks that: masked logprobs are renormalised
over the allowed tokens, and forbidden tokens get -inf.
"""
from __future__ import annotations

import dataclasses

from ninfer.outputs import Completion

BF16_LOGPROB_TOL = 0.15  # nats: a few bf16 ulps of logits of magnitude ~10


def assert_same_up_to_rounding(got: Completion, ref: Completion, *, greedy: bool, upto: int | None = None,
                               tol: float = BF16_LOGPROB_TOL) -> None:
    """``got`` and ``ref`` (both generated with ``logprobs`` >= 1) are one request's tokens from two
    runs: equal, or equal up to a rounding divergence as the module docstring defines it. ``upto``
    compares only the first tokens (where the runs were asked for different things after them)."""
    if upto is not None:
        got = dataclasses.replace(got, token_ids=got.token_ids[:upto], logprobs=(got.logprobs or [])[:upto] or None)
        ref = dataclasses.replace(ref, token_ids=ref.token_ids[:upto], logprobs=(ref.logprobs or [])[:upto] or None)
    if got.token_ids == ref.token_ids:
        return
    assert got.logprobs is not None and ref.logprobs is not None, "ask both runs for logprobs"
    n = min(len(got.token_ids), len(ref.token_ids))
    i = next((j for j in range(n) if got.token_ids[j] != ref.token_ids[j]), n)
    for j in range(i):  # the common prefix: same contexts, so the same distributions up to rounding
        t = got.token_ids[j]
        a, b = got.logprobs[j][t].logprob, ref.logprobs[j][t].logprob
        assert abs(a - b) <= tol, f"token {j} ({t}): logprob {a:.4f} batched vs {b:.4f} alone"
    if i == n:  # one is a prefix of the other: a stop (token, string, grammar end) met in one run only
        longer = got if len(got.token_ids) > n else ref
        assert longer.finish_reason in ("length", "stop"), f"{longer.finish_reason} after {n} common tokens"
        return
    chosen, alone_top = got.token_ids[i], ref.token_ids[i]
    alternatives = ref.logprobs[i]
    if greedy:
        assert chosen in alternatives, f"token {i}: batched greedy {chosen} is not among the lone run's top tokens"
        gap = alternatives[alone_top].logprob - alternatives[chosen].logprob
        assert gap <= tol, f"token {i}: batched greedy {chosen} trails the lone run's {alone_top} by {gap:.4f} nats"
    elif chosen in alternatives:  # sampled: the same draw may fall on a neighbouring token after rounding
        a, b = got.logprobs[i][chosen].logprob, alternatives[chosen].logprob
        assert abs(a - b) <= tol, f"token {i} ({chosen}): logprob {a:.4f} batched vs {b:.4f} alone"
