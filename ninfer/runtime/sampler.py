"""Per-lane sampling state on the device, and the one call that turns a batch of logits into tokens.

Each lane keeps its request's sampling parameters, its counter-based RNG state (seed, counter)
and, for penalties, the counts of generated tokens and the set of seen (prompt + generated)
tokens. A batch gathers the rows of its lanes; when no request in it uses penalties, a scratch
buffer stands in for the counts so nothing vocabulary-sized is copied per step.
"""
from __future__ import annotations

import dataclasses
import random

import torch

from ninfer.kernels.sampling import SamplingTensors, sample
from ninfer.runtime.request import Request

TokenLogprobs = tuple[int, float, list[tuple[int, float]]]
LaneState = tuple[int, int]  # (seed, counter) of the counter-based RNG


def _uses_penalties(req: Request) -> bool:
    p = req.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class Sampler:
    def __init__(self, max_lanes: int, vocab_size: int, vocab_limit: int, device: torch.device) -> None:
        self.vocab_limit = vocab_limit
        self.device = device
        self.st = SamplingTensors.full(max_lanes, device=device)
        self.counts = torch.zeros(max_lanes, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(max_lanes, vocab_size, dtype=torch.int8, device=device)
        self._scratch_counts = torch.zeros_like(self.counts)
        self._scratch_seen = torch.zeros_like(self.seen)

    def start(self, req: Request, resume: LaneState | None = None) -> None:
        """Load a newly admitted request's parameters into its lane; ``resume`` (from :meth:`lane_state`)
        continues the random stream of a paused request where it stopped."""
        p, lane = req.params, req.lane
        seed, counter = resume if resume is not None else (
            p.seed if p.seed is not None else random.getrandbits(62), 0)
        values = dict(temperature=0.0 if p.is_greedy else p.temperature, top_k=p.top_k, top_p=p.top_p,
                      min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                      repetition_penalty=p.repetition_penalty, seed=seed, counter=counter)
        for name, value in values.items():
            getattr(self.st, name)[lane] = value
        if _uses_penalties(req):
            # The penalty state is a function of the tokens, so a resumed lane rebuilds it exactly.
            seen = torch.tensor(req.prompt_ids + req.output_ids, device=self.device)
            self.counts[lane].zero_()
            if req.output_ids:
                out = torch.tensor(req.output_ids, device=self.device)
                self.counts[lane] = torch.bincount(out, minlength=self.counts.shape[1]).to(self.counts.dtype)
            self.seen[lane].zero_()
            self.seen[lane, seen] = 1

    def lane_state(self, req: Request) -> LaneState:
        """The (seed, counter) of a request's lane, for :meth:`start` after a pause (one host sync)."""
        return int(self.st.seed[req.lane]), int(self.st.counter[req.lane])

    def finish(self, req: Request) -> None:
        """Nothing to free: lane state is overwritten by the next request that takes the lane."""

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Tokens for each row of ``logits [b, V]`` (row i belongs to ``reqs[i]``), plus logprobs where asked."""
        b = len(reqs)
        lanes = torch.tensor([r.lane for r in reqs], dtype=torch.long, device=self.device)
        st = SamplingTensors(**{f.name: getattr(self.st, f.name)[lanes] for f in dataclasses.fields(self.st)})
        penalties = any(_uses_penalties(r) for r in reqs)
        counts = self.counts[lanes] if penalties else self._scratch_counts[:b]
        seen = self.seen[lanes] if penalties else self._scratch_seen[:b]
        n_logprobs = max((r.params.logprobs or 0) for r in reqs)
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        out = sample(logits, st, counts, seen, vocab_limit=self.vocab_limit, num_logprobs=n_logprobs)
        self.st.counter[lanes] = st.counter
        if penalties:
            self.counts[lanes] = counts
            self.seen[lanes] = seen
        tokens = out.token_ids.tolist()
        if not want_logprobs:
            return tokens, [None] * b
        logprob = out.logprob.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in reqs]
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in reqs]
        result: list[TokenLogprobs | None] = []
        for i, r in enumerate(reqs):
            if r.params.logprobs is None:
                result.append(None)
            else:
                n = r.params.logprobs
                result.append((tokens[i], logprob[i], list(zip(top_ids[i][:n], top_lps[i][:n]))))
        return tokens, result
