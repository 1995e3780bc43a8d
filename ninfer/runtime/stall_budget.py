"""How many prompt tokens a step may prefill beside decoding sequences, from measured step times.

Every token a decoding sequence receives waits for its whole step, so a step that also prefills a chunk of a
long prompt stalls it: 1,024 prompt tokens of the 27B at 32k context take ~160 ms against a 7.3 ms decode step
(H200). A fixed ``prefill_tokens_while_decoding`` bounds that stall only as well as its author guessed the
model, the GPU and the context. With ``max_decode_stall`` the engine bounds the step's time instead:

    tokens = (bound - decode step) / seconds per prompt token

The decode step is a moving average over steps that prefill nothing; the cost of a prompt token one over steps
that prefill beside decodes (the step's time less the decode step, over its prompt tokens), so it follows the
prompt at hand: attention over a growing context makes later tokens dearer, and the budget shrinks with it.
Until both have been seen the fixed budget applies. A bound is absolute (``"40ms"``) or a multiple of the
decode step (``"3x"``: the inter-token latency of decoding sequences stays within three of their steady
time per token).

The model is linear in the prompt tokens. Where a step beside decodes pays a fixed cost for having any (a
GEMM path that re-reads every weight per chunk, decode rows run as a forward of their own), the cost per token
it measures grows as the chunk shrinks; a bound below that fixed cost cannot be met by chunking, and the
budget then settles at its floor, :data:`LEAST_TOKENS` a step.

Where the engine replays a prompt-chunk graph (:mod:`ninfer.runtime.chunk_graphs`) only chunks of the graph's
length replay; any other runs eagerly, and an eager step beside decodes costs far more than its tokens say
(27B ``int4``, H200: 100-150 ms for any chunk up to a few hundred tokens, against 21 ms for the 16-token graph's
step, run 2026-12-04.22). One cost per token over both kinds would keep trying a few tokens more than the graph
holds, each try an eager step far over the bound. So the two are measured apart: the graph's step (its cost per
token serves as a first guess), and eager steps' cost per token. The budget is the graph's length unless the
eager cost, or before any eager step the graph's own, says a longer chunk fits; an eager chunk is first tried only
where the bound leaves room for :data:`EXPLORE_GRAPH_STEPS` graph steps, and after an eager step over the bound
the next :data:`GRAPH_AFTER_MISS` steps beside decodes stay at the graph's length (a linear cost per token
cannot see an eager step's fixed cost, so shrinking the eager chunk would take many steps over the bound). A
bound that eager steps cannot meet thus costs one step over it per that many steps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

LEAST_TOKENS = 32  # a step always makes some progress on the prompt, whatever the bound
EXPLORE_GRAPH_STEPS = 4  # with a chunk graph, an eager chunk is tried only where this many graph steps would fit
GRAPH_AFTER_MISS = 256  # steps beside decodes at the graph's length after an eager one over the bound
SMOOTHING = 0.25  # weight of the newest step in the moving averages
_BOUND = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|x)\s*$")


@dataclass(frozen=True)
class StallBound:
    """The most a step that prefills beside decodes may take: ``seconds``, or ``factor`` x the decode step."""

    seconds: float | None = None
    factor: float | None = None

    @classmethod
    def parse(cls, text: str) -> StallBound:
        """``"40ms"`` or ``"3x"`` (a multiple above 1); ValueError saying what is accepted otherwise."""
        bound = cls._read(text)
        if isinstance(bound, str):
            raise ValueError(f"{bound}, got {text!r}")
        return bound

    @classmethod
    def problem(cls, text: str) -> str | None:
        """What is wrong with ``text`` as a bound (None: nothing), as engine options' checks say it."""
        bound = cls._read(text)
        return bound if isinstance(bound, str) else None

    @classmethod
    def _read(cls, text: str) -> StallBound | str:
        match = _BOUND.match(text)
        if match is None:
            return "must be milliseconds ('40ms') or a multiple of a decode step ('3x')"
        value, unit = float(match.group(1)), match.group(2)
        if unit == "ms":
            return cls(seconds=value / 1e3) if value > 0 else "must be a positive number of milliseconds"
        return cls(factor=value) if value > 1 else "must be more than one decode step ('1.5x' or more)"

    def limit(self, decode_s: float) -> float:
        """The bound in seconds, given the decode step's."""
        return self.seconds if self.seconds is not None else self.factor * decode_s


class StallBudget:
    """The prompt tokens of the next step beside decodes (:meth:`tokens`), from the steps seen so far
    (:meth:`observe`); ``initial`` until a decode step and a mixed step have both been seen, never more
    than ``most`` (the prefill chunk) nor fewer than ``least`` (:data:`LEAST_TOKENS`, or the prompt-chunk graph's
    length: :meth:`replays_chunks_of`)."""

    def __init__(self, bound: StallBound, *, initial: int, most: int) -> None:
        self.bound, self.initial, self.most = bound, min(initial, most), most
        self.decode_s: float | None = None  # a step that only decodes
        self.token_s: float | None = None  # one prompt token's share of an (eager) step beside decodes
        self.graph_tokens = 0  # the chunk length the engine replays from a graph (0: none)
        self.graph_s: float | None = None  # what such a replayed chunk adds to a step beside decodes
        self.graph_only = 0  # steps beside decodes left at the graph's length (after an eager step over the bound)

    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        """A step's wall time, its prompt tokens and its decoding sequences. Steps with nothing decoding stall
        nobody and say nothing about either cost (their chunk is the prefill chunk)."""
        if decode_rows == 0 or seconds <= 0:
            return
        if prefill_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0)
            if prefill_tokens == self.graph_tokens:
                self.graph_s = _average(self.graph_s, extra)
                self.graph_only = max(self.graph_only - 1, 0)
            elif prefill_tokens < self.graph_tokens:
                return  # a prompt's last, short chunk (eager): no budget chose it, its fixed cost would mislead
            else:
                self.token_s = _average(self.token_s, extra / prefill_tokens)
                if self.graph_tokens and seconds > self.bound.limit(self.decode_s):
                    self.graph_only = GRAPH_AFTER_MISS

    def replays_chunks_of(self, tokens: int) -> None:
        """The engine replays a graph for chunks of ``tokens``: never plan fewer (they would run eagerly), and plan
        more only where eager steps are measured, or expected, to fit."""
        self.graph_tokens = min(tokens, self.most)

    @property
    def least(self) -> int:
        """The fewest prompt tokens a step beside decodes plans: the graph's length where one replays, else
        :data:`LEAST_TOKENS` (never past the prefill chunk)."""
        return self.graph_tokens or min(LEAST_TOKENS, self.most)

    def tokens(self) -> int:
        if self.decode_s is None:
            return self.initial
        room = self.bound.limit(self.decode_s) - self.decode_s
        if self.graph_tokens:
            return self._beside_graph(room)
        if self.token_s is None:
            return self.initial
        if self.token_s == 0:
            return self.most
        return int(min(max(room / self.token_s, self.least), self.most))

    def _beside_graph(self, room: float) -> int:
        """The budget with a chunk graph, given the bound's room beside the decode step: the graph's length, or an
        eager chunk that the measured eager cost per token (before any eager step: the graph's, where the room
        holds several graph steps) says fits."""
        if self.graph_only:
            return self.graph_tokens
        per_token = self.token_s
        if per_token is None:
            if self.graph_s is None:
                return self.initial
            if room < EXPLORE_GRAPH_STEPS * self.graph_s:
                return self.graph_tokens
            per_token = self.graph_s / self.graph_tokens
        fits = room / per_token if per_token > 0 else self.most
        return int(min(fits, self.most)) if fits > self.graph_tokens else self.graph_tokens


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * value
