"""Per-lane sampling state on the device, and the one call that turns a batch of logits into tokens.

Each lane keeps its request's sampling parameters, its counter-based RNG state (seed, counter)
and, for penalties, the counts of generated tokens and the set of seen (prompt + generated)
tokens. A batch gathers the rows of its lanes; when no request in it uses penalties, a scratch
buffer stands in for the counts so nothing vocabulary-sized is copied per step.

Structured output: the sampler owns a pinned host token bitmask and its device twin, sized for
``max_rows`` rows (lanes x (K + 1) with speculation). A step with constrained requests fills only
their rows on the host (xgrammar), copies them with ``non_blocking=True`` on the current stream and
hands the device buffer and the row index to the fused kernel; a step without any passes nothing.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import torch

from ninfer.kernels.sampling import SampleOutput, SamplingTensors, apply_bitmask, sample, suppress_tokens
from ninfer.kernels.sampling.dispatch import LOGPROB_CLASSES
from ninfer.runtime.request import Request
from ninfer.runtime.structured import fill_bitmask

TokenLogprobs = tuple[int, float, list[tuple[int, float]]]
LaneState = tuple[int, int]  # (seed, counter) of the counter-based RNG


def _uses_penalties(req: Request) -> bool:
    p = req.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _check_fits(name: str, value: float, dtype: torch.dtype) -> None:
    """Raise a ValueError naming the parameter whose value the lane's ``dtype`` cannot hold."""
    if dtype.is_floating_point:
        if not math.isfinite(float(value)) or abs(float(value)) > torch.finfo(dtype).max:
            raise ValueError(f"{name}={value} is not a finite {dtype} value")
    else:
        info = torch.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            raise ValueError(f"{name}={value} is outside the sampler's range [{info.min}, {info.max}]")


class Sampler:
    def __init__(self, max_lanes: int, vocab_size: int, vocab_limit: int, device: torch.device,
                 max_rows: int | None = None) -> None:
        self.vocab_limit = vocab_limit
        self.device = device
        self._mask_words = -(-vocab_size // 32)
        self._alloc_mask(max_rows or max_lanes)
        self.st = SamplingTensors.full(max_lanes, device=device)
        self.counts = torch.zeros(max_lanes, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(max_lanes, vocab_size, dtype=torch.int8, device=device)
        self._scratch_counts = torch.zeros_like(self.counts)
        self._scratch_seen = torch.zeros_like(self.seen)
        self._lane_tensors: dict[tuple[int, ...], torch.Tensor] = {}

    def start(self, req: Request, resume: LaneState | None = None) -> None:
        """Load a newly admitted request's parameters into its lane; ``resume`` (from :meth:`lane_state`)
        continues the random stream of a paused request where it stopped."""
        p, lane = req.params, req.lane
        seed, counter = resume if resume is not None else (
            p.seed if p.seed is not None else random.getrandbits(62), 0)
        values = dict(temperature=0.0 if p.is_greedy else p.temperature, top_k=p.top_k, top_p=p.top_p,
                      min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                      repetition_penalty=p.repetition_penalty, seed=seed, counter=counter)
        for name, value in values.items():  # checked first: a lane is never left half written
            _check_fits(name, value, getattr(self.st, name).dtype)
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

    @torch.inference_mode()
    def warm_up(self, model: Any) -> None:
        """Launch the sampling kernel once per top-logprobs class and mask variant (each compiled) on a row of logits
        that ``model`` (a ``Qwen3_5TextModel``) computes, so its dtype and width are the served ones, with
        throwaway state: no request compiles it. Lane state is untouched."""
        hidden = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=self.device)
        row = model.logits(hidden)
        vocab = self.counts.shape[1]
        # Each class with and without the structured-output mask (the kernel's HAS_MASK variants).
        allow_all = torch.full((1, self._mask_words), -1, dtype=torch.int32, device=self.device)
        first_row = torch.zeros(1, dtype=torch.int32, device=self.device)
        for n in LOGPROB_CLASSES:
            for mask in ({}, dict(bitmask=allow_all, mask_rows=first_row)):
                counts = torch.zeros(1, vocab, dtype=torch.int32, device=self.device)
                seen = torch.zeros(1, vocab, dtype=torch.int8, device=self.device)
                sample(row, SamplingTensors.full(1, device=self.device), counts, seen, vocab_limit=self.vocab_limit,
                       num_logprobs=n, **mask)

    def _alloc_mask(self, rows: int) -> None:
        pinned = self.device.type == "cuda"
        self._mask_host = torch.full((rows, self._mask_words), -1, dtype=torch.int32, pin_memory=pinned)
        self._mask_rows_host = torch.full((rows,), -1, dtype=torch.int32, pin_memory=pinned)
        if pinned:
            self._mask_dev = torch.full_like(self._mask_host, -1, device=self.device)
            self._mask_rows_dev = torch.full_like(self._mask_rows_host, -1, device=self.device)
        else:  # the CPU path reads the host buffers directly
            self._mask_dev, self._mask_rows_dev = self._mask_host, self._mask_rows_host
        self._mask_copied: torch.cuda.Event | None = None

    def _token_mask(self, reqs: list[Request], rows_per_req: int,
                    drafts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The device bitmask and row index for this step's constrained rows; None when none is.

        Called before anything in the step that waits on the device, so this host work (xgrammar's
        fill) overlaps the step's forward, which is already queued. The only wait is for the previous
        step's copy out of the pinned buffer, long done by then (its tokens were read since).
        """
        if all(r.grammar is None for r in reqs):
            return None
        n_rows = len(reqs) * rows_per_req
        if self._mask_copied is not None:
            self._mask_copied.synchronize()
        if n_rows > self._mask_host.shape[0]:  # only past max_rows: more rows than the engine planned
            self._alloc_mask(n_rows)
        used = fill_bitmask(self._mask_host, self._mask_rows_host[:n_rows], reqs, rows_per_req, drafts)
        if not used:
            return None
        if self._mask_dev is not self._mask_host:
            self._mask_dev[:used].copy_(self._mask_host[:used], non_blocking=True)
            self._mask_rows_dev[:n_rows].copy_(self._mask_rows_host[:n_rows], non_blocking=True)
            self._mask_copied = torch.cuda.Event()
            self._mask_copied.record()
        return self._mask_dev, self._mask_rows_dev[:n_rows]

    def lane_state(self, req: Request) -> LaneState:
        """The (seed, counter) of a request's lane, for :meth:`start` after a pause (one host sync)."""
        return int(self.st.seed[req.lane]), int(self.st.counter[req.lane])

    def finish(self, req: Request) -> None:
        """Nothing to free: lane state is overwritten by the next request that takes the lane."""

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Tokens for each row of ``logits [b, V]`` (row i belongs to ``reqs[i]``), plus logprobs where asked."""
        draw = self.launch(logits, reqs)
        tokens = draw.out.token_ids.tolist()
        if not draw.want_logprobs:
            return tokens, [None] * len(reqs)
        return tokens, [lps[0] for lps in self.logprobs(draw, [[t] for t in tokens])]

    def launch(self, logits: torch.Tensor, reqs: list[Request]) -> Draw:
        """Queue the draw of one token per row of ``logits [b, V]`` and commit it; the tokens stay on the device
        (``draw.out.token_ids``). Nothing here waits for the device unless a request is constrained by a grammar."""
        draw = self._draw(logits, reqs, 1, None)
        self.commit(draw)
        return draw

    def draw_rows(self, logits: torch.Tensor, reqs: list[Request], drafts: torch.Tensor) -> Draw:
        """Speculative verification: row ``j`` of request ``b`` (``logits [b * T, V]``, ``T = K + 1``)
        is sampled as the token that would follow drafts ``d_1 .. d_j``, with the RNG counter and the
        penalty state it would have then; nothing is committed until :meth:`commit` picks a row."""
        return self._draw(logits, reqs, drafts.shape[1] + 1, drafts)

    def _draw(self, logits: torch.Tensor, reqs: list[Request], rows_per_req: int, drafts: torch.Tensor | None) -> Draw:
        b, t = len(reqs), rows_per_req
        mask = self._token_mask(reqs, t, drafts)  # first: the tensors below wait on the device
        lanes = self._lanes(reqs)
        rows = lanes.repeat_interleave(t) if t > 1 else lanes
        st = SamplingTensors(**{f.name: getattr(self.st, f.name)[rows] for f in dataclasses.fields(self.st)})
        if t > 1:  # row j draws with the counter of the j-th next token
            st.counter += torch.arange(t, device=self.device).repeat(b)
        penalties = any(_uses_penalties(r) for r in reqs)
        if penalties:
            counts, seen = self.counts[rows], self.seen[rows]
            if drafts is not None and t > 1:  # row j has already seen drafts d_1 .. d_j
                vocab = counts.shape[1]
                extra = torch.zeros(b, t - 1, vocab, dtype=counts.dtype, device=self.device)
                extra.scatter_(2, drafts[:, :, None], 1)
                extra = extra.cumsum(1)
                counts.view(b, t, vocab)[:, 1:] += extra
                seen.view(b, t, vocab)[:, 1:] |= (extra > 0).to(seen.dtype)
        else:
            counts, seen = self._scratch(b * t)
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        n_logprobs = max((r.params.logprobs or 0) for r in reqs)
        if mask is not None and self._suppresses(reqs, t):
            # min_tokens must see the grammar's mask (see suppress_tokens): apply it to the logits first.
            logits, mask = apply_bitmask(logits, *mask), None
        self._suppress_stops(logits, reqs, t)
        self._force_think_end(logits, reqs, t)
        bitmask, mask_rows = mask if mask is not None else (None, None)
        out = sample(logits, st, counts, seen, vocab_limit=self.vocab_limit, num_logprobs=n_logprobs,
                     bitmask=bitmask, mask_rows=mask_rows)
        return Draw(reqs, lanes, t, out, st, counts if penalties else None, seen if penalties else None,
                    want_logprobs)

    @staticmethod
    def _force_think_end(logits: torch.Tensor, reqs: list[Request], rows_per_req: int) -> None:
        """Thinking budgets: the row that draws a request's output token ``thinking_budget`` (the first such
        row, if reasoning is still open) can only draw ``</think>``. Later rows of a speculative round follow a
        draft, which verification rejects unless it was ``</think>`` too. A grammar masks nothing on that row:
        its constraint starts after ``</think>``."""
        rows: list[int] = []
        ids: list[int] = []
        for b, req in enumerate(reqs):
            if req.think_end is None or req.params.thinking_budget is None:
                continue
            j = max(0, req.params.thinking_budget - len(req.output_ids))
            if j < rows_per_req:
                rows.append(b * rows_per_req + j)
                ids.append(req.think_end)
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = float("-inf")
            logits[index, torch.tensor(ids, dtype=torch.long, device=logits.device)] = 0.0

    @staticmethod
    def _suppresses(reqs: list[Request], rows_per_req: int) -> bool:
        return any(req.min_tokens_ids and req.params.min_tokens > len(req.output_ids) for req in reqs)

    def _suppress_stops(self, logits: torch.Tensor, reqs: list[Request], rows_per_req: int) -> None:
        """``min_tokens``: row ``j`` of a request draws its output token ``len(output_ids) + j``; while that is
        below the minimum its stop ids get ``-inf``. After the grammar mask, so a grammar that can only end
        still ends (see :func:`suppress_tokens`); batches without such rows launch nothing."""
        rows: list[int] = []
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        vocab = logits.shape[1]
        for b, req in enumerate(reqs):
            need = min(req.params.min_tokens - len(req.output_ids), rows_per_req)
            ids = [i for i in req.min_tokens_ids if i < vocab]  # larger ids can never be drawn
            for j in range(need if ids else 0):
                pair_rows.extend([len(rows)] * len(ids))
                pair_ids.extend(ids)
                rows.append(b * rows_per_req + j)
        if not rows:
            return
        dev = self.device
        suppress_tokens(logits, torch.tensor(rows, device=dev), torch.tensor(pair_rows, device=dev),
                        torch.tensor(pair_ids, device=dev), vocab_limit=self.vocab_limit)

    def commit(self, draw: Draw, rows: torch.Tensor | None = None) -> None:
        """Keep, per request, the sampler state after its row ``rows[b]`` (the last committed token; the
        only row when each request drew one)."""
        if rows is None:
            assert draw.rows_per_req == 1
            pick = slice(None)
        else:
            pick = torch.arange(len(draw.reqs), device=self.device) * draw.rows_per_req + rows
        self.st.counter[draw.lanes] = draw.st.counter[pick]
        if draw.counts is not None:
            self.counts[draw.lanes] = draw.counts[pick]
            self.seen[draw.lanes] = draw.seen[pick]

    @staticmethod
    def logprobs(draw: Draw, tokens: list[list[int]]) -> list[list[TokenLogprobs | None]]:
        """Per request, the logprobs of its committed tokens (row j for the j-th), or Nones where not asked."""
        t = draw.rows_per_req
        logprob = draw.out.logprob.tolist()
        n = draw.out.top_ids.shape[1] if draw.out.top_ids is not None else 0
        top_ids = draw.out.top_ids.tolist() if n else None
        top_lps = draw.out.top_logprobs.tolist() if n else None
        result = []
        for b, (req, toks) in enumerate(zip(draw.reqs, tokens)):
            k = req.params.logprobs
            if k is None:
                result.append([None] * len(toks))
                continue
            rows = range(b * t, b * t + len(toks))
            result.append([(tok, logprob[r], list(zip(top_ids[r][:k], top_lps[r][:k])) if n else [])
                           for tok, r in zip(toks, rows)])
        return result

    def _lanes(self, reqs: list[Request]) -> torch.Tensor:
        """The batch's lanes on the device, made once per lane tuple: building them from a list each step would
        be a synchronous copy, the host then waiting for every queued kernel (a decode step run ahead of its
        tokens, ``ninfer.runtime.run_ahead``, would wait for the step before)."""
        key = tuple(r.lane for r in reqs)
        lanes = self._lane_tensors.get(key)
        if lanes is None:
            if len(self._lane_tensors) >= 256:  # lane tuples of a long run: keep the table small
                self._lane_tensors.clear()
            lanes = self._lane_tensors[key] = torch.tensor(key, dtype=torch.long, device=self.device)
        return lanes

    def _scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero penalty state for ``rows`` rows (no request in the batch uses penalties)."""
        if self._scratch_counts.shape[0] < rows:
            self._scratch_counts = torch.zeros(rows, self.counts.shape[1], dtype=torch.int32, device=self.device)
            self._scratch_seen = torch.zeros(rows, self.counts.shape[1], dtype=torch.int8, device=self.device)
        return self._scratch_counts[:rows], self._scratch_seen[:rows]


@dataclasses.dataclass
class Draw:
    """Rows drawn for a batch of requests, before the caller commits one row per request."""

    reqs: list[Request]
    lanes: torch.Tensor
    rows_per_req: int
    out: SampleOutput
    st: SamplingTensors
    counts: torch.Tensor | None
    seen: torch.Tensor | None
    want_logprobs: bool
