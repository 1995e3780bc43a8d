"""Speculative decoding with the MTP head: draft K tokens, verify them in one target step, keep the
longest prefix the target agrees with (reference §10, docs/speculative.md).

One round for every decoding lane at once, all on the device (one CUDA graph per batch size)::

    catch-up   the head over K+1 pairs (h_t, x_{t+1}) from the previous round's verification
               (the valid ones are t = start .. start + a; the rest are padding whose MTP K/V is
               overwritten later), which fixes the MTP K/V of the accepted tokens and gives d_1
    draft      K - 1 more single-token head steps: d_2 .. d_K (greedy, argmax)
    verify     the target over [x_n, d_1 .. d_K] at positions n .. n+K in one batch; every DeltaNet
               layer writes the state after each token to its own slot (``state_out_slots``)

The engine then samples every verify row with the request's own sampler settings (row ``j`` as
the token after ``d_1 .. d_j``, with the RNG counter and penalty state it would have then) and
accepts ``a`` drafts: the longest prefix with ``y_j == d_{j+1}``, plus the target's own token
``y_a``. Because the drafts are point masses, "accept ``d`` iff the target's sample equals it" is
exactly speculative rejection sampling (accept with probability ``p(d)``, else draw from
``p`` without ``d``, renormalised), so outputs follow the target distribution; with the
counter-based RNG the committed token at each index even uses the same uniform as without
speculation. Rollback is a choice of slot: the sequence's state becomes the slot after token ``a``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ninfer.kernels.spec_rows import RoundRows, round_rows
from ninfer.models.batch import ForwardBatch, make_batch
from ninfer.models.mtp import MTPHead
from ninfer.runtime.draft_vocab import draft_token_ids
from ninfer.runtime.graphs import capture
from ninfer.runtime.model_runner import ModelRunner
from ninfer.runtime.request import Request

MAX_DRAFT_TOKENS = 7  # verification runs K + 1 <= 8 tokens per sequence through the decode kernels


@dataclass
class SpecStats:
    """Per-request speculation counters (also summed engine-wide for metrics)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds that accepted draft i + 1

    def record(self, drafted: int, accepted: int) -> None:
        self.add(SpecStats(1, drafted, accepted, [1] * accepted + [0] * (drafted - accepted)))

    def add(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.accepted_at.extend([0] * (len(other.accepted_at) - len(self.accepted_at)))
        for i, n in enumerate(other.accepted_at):
            self.accepted_at[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens committed per verification round (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, object]:
        per_position = [n / self.rounds if self.rounds else 0.0 for n in self.accepted_at]
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4), "tokens_per_round": round(self.tokens_per_round, 4),
                "acceptance_per_position": [round(p, 4) for p in per_position]}


def accepted_drafts(sampled: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """``[B]`` drafts accepted: the leading run of ``sampled[:, j] == drafts[:, j]`` (``sampled [B, K+1]``)."""
    return (sampled[:, :-1] == drafts).long().cumprod(1).sum(1)


def committed_tokens(sampled: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``[B, K+1]``: ``d_1 .. d_a`` then the target's ``y_a``; entries after ``a`` are padding (``y``)."""
    j = torch.arange(sampled.shape[1], device=sampled.device)
    padded = torch.cat([drafts, sampled[:, -1:]], 1)
    return torch.where(j[None] < accepted[:, None], padded, sampled)


class MTPSpeculator:
    """Device buffers per lane and the draft + verify round; rounds replay CUDA graphs on GPU."""

    def __init__(self, runner: ModelRunner, head: MTPHead, *, vocab_limit: int) -> None:
        """Rounds of ``runner.config.draft_tokens`` drafts over the runner's model, cache and block tables, for
        up to ``max_concurrency`` lanes; captured as CUDA graphs on GPU unless ``cuda_graphs`` is off."""
        config, model = runner.config, runner.model
        draft_tokens, max_lanes, lane_block_tables = config.draft_tokens, config.max_concurrency, runner.block_tables
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}")
        self.model, self.head, self.cache, self.lane_block_tables = model, head, runner.cache, lane_block_tables
        self.mtp_cache = runner.cache.mtp_view()
        self.k, self.t = draft_tokens, draft_tokens + 1
        self.vocab_limit = vocab_limit
        # The drafts' own LM head where a draft vocabulary narrows it (draft_vocab): its rows, dequantized once.
        self.draft_ids = draft_token_ids(config.draft_vocab, vocab_limit, lane_block_tables.device)
        self.draft_rows = None if self.draft_ids is None else model.lm_head_rows(self.draft_ids)
        dev, t, hidden = lane_block_tables.device, self.t, model.config.hidden_size
        long = dict(dtype=torch.long, device=dev)
        # What the previous round left per lane: the target's hidden states at positions
        # start .. start + K, the tokens after them, and how many drafts it accepted.
        self.hidden = torch.zeros(max_lanes, t, hidden, dtype=model.dtype, device=dev)
        self.tokens = torch.zeros(max_lanes, t, **long)
        self.start = torch.zeros(max_lanes, **long)
        self.accepted = torch.zeros(max_lanes, **long)
        self.rope_delta = torch.zeros(max_lanes, **long)
        # Graph inputs of a round over b lanes: its lanes [b], state slots [b] and per-token state slots [b, t], in
        # one block (a round's graph reads the views of its b), so one copy from pinned memory fills all three; each
        # starts 16-byte aligned (at a multiple of two entries), as separate tensors would.
        self._inputs = torch.zeros((max_lanes + 1) * (2 + t), **long)
        self._views = {b: (self._inputs[:b], self._inputs[_even(b):_even(b) + b],
                           self._inputs[2 * _even(b):2 * _even(b) + b * t].view(b, t))
                       for b in range(1, max_lanes + 1)}
        self.block_tables = torch.zeros(max_lanes, lane_block_tables.shape[1], dtype=torch.int32, device=dev)
        self._cu = {n: torch.arange(max_lanes + 1, dtype=torch.int32, device=dev) * n for n in (1, t)}
        self._plans = {b: RoundPlan(b, self.k, dev) for b in range(1, max_lanes + 1)}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._last_hidden: dict[int, torch.Tensor] = {}  # lane -> prompt's last hidden state, until begin()
        # Test hook: ``propose(lanes [b], n [b], drafts [b, K]) -> drafts`` replaces the head's drafts
        # (tests drive full acceptance and every rejection path with it; eager rounds only).
        self.propose: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if config.cuda_graphs and dev.type == "cuda":
            pool = None
            for b in range(max_lanes, 0, -1):  # largest first, so smaller graphs reuse its memory pool
                pool = self._capture(b, pool)

    # -- per request --------------------------------------------------------------------------------
    def prefill(self, req: Request, hidden: torch.Tensor, batch: ForwardBatch, start: int, end: int) -> None:
        """After the target prefilled tokens ``[start, end)`` (of the prompt, or of a paused request's
        replay): write their MTP K/V (pairs whose next token is known, i.e. all but the last of the
        prefill) and keep the last hidden state."""
        n = req.prefill_target
        pairs = min(end, n - 1) - start
        if pairs > 0:
            dev = hidden.device
            ids = torch.tensor(req.tokens(start + 1, start + 1 + pairs), dtype=torch.long, device=dev)
            mtp_batch = make_batch(input_ids=ids, positions=batch.positions[:, :pairs], seq_lens=[pairs],
                                   context_lens=[start + pairs], block_tables=batch.block_tables,
                                   slot_mapping=batch.slot_mapping[:pairs], state_slots=batch.state_slots)
            self.head.advance(hidden[:pairs], ids, mtp_batch, self.mtp_cache)
        if end == n:
            self._last_hidden[req.lane] = hidden[-1]

    def warm_up_chunk(self, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        """Run the head as :meth:`prefill` does over a chunk's pairs, here every token of a start-up warm-up
        chunk (``batch`` is the target's, on scratch pages): the head's attention and projections compile and
        tune per length class as the target's do, so warm-up must meet each class with the head too."""
        self.head.advance(hidden, batch.input_ids, batch, self.mtp_cache)

    def begin(self, req: Request, token: int) -> None:
        """The prompt (or a replay) is in; ``token`` (x_n) was sampled from its last hidden state: the
        first round's catch-up is the single pair (h_{n-1}, x_n) at position n - 1."""
        lane = req.lane
        self.hidden[lane, 0] = self._last_hidden.pop(lane)
        self.tokens[lane] = token
        self.start[lane] = req.prefill_target - 1
        self.accepted[lane] = 0
        self.rope_delta[lane] = req.rope_delta

    def save_lane(self, lane: int) -> tuple[torch.Tensor, ...]:
        """A lane's draft state (a paused request keeps it with its snapshot)."""
        return tuple(t[lane].clone() for t in (self.hidden, self.tokens, self.start, self.accepted))

    def restore_lane(self, lane: int, saved: tuple[torch.Tensor, ...], rope_delta: int) -> None:
        for t, value in zip((self.hidden, self.tokens, self.start, self.accepted), saved, strict=True):
            t[lane] = value
        self.rope_delta[lane] = rope_delta

    # -- one round ----------------------------------------------------------------------------------
    def run(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft and verify for ``reqs`` (their pages must cover ``num_computed + K + 1`` tokens).

        Returns ``(drafts [b, K], verify logits [b * (K+1), V], verify hidden [b * (K+1), H],
        n [b])``, valid until the next round.
        """
        b = len(reqs)
        pad = [0] * (_even(b) - b)
        host = [r.lane for r in reqs] + pad + [r.slot for r in reqs] + pad + [s for r in reqs for s in r.spare_slots]
        assert len(host) == 2 * _even(b) + b * self.t, "every request holds K + 1 spare state slots"
        # From pinned memory: a copy from pageable memory holds the host until it is staged (the caching host
        # allocator keeps the pinned buffer until the copy has run).
        self._inputs[:len(host)].copy_(torch.tensor(host, dtype=torch.long, pin_memory=self._inputs.is_cuda),
                                       non_blocking=True)
        if b in self.graphs and self.propose is None:
            self.graphs[b].replay()
            return self.outputs[b]
        return self._forward(b)

    def acceptance(self, sampled: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """``[B]`` drafts each lane accepts (:func:`accepted_drafts`; benchmarks: :func:`force_acceptance`)."""
        return accepted_drafts(sampled, drafts)

    def advance(self, reqs: list[Request], hidden: torch.Tensor, committed: torch.Tensor, accepted: torch.Tensor,
                n: torch.Tensor) -> None:
        """Keep this round's verification for the next round's catch-up."""
        lanes = self._views[len(reqs)][0]
        self.hidden.index_copy_(0, lanes, hidden.view(len(reqs), self.t, -1))
        self.tokens.index_copy_(0, lanes, committed)
        self.start.index_copy_(0, lanes, n)
        self.accepted.index_copy_(0, lanes, accepted)

    # -- the device computation ---------------------------------------------------------------------
    def _batch(self, b: int, rows: RoundRows, plan: RoundPlan, forward: int, ids: torch.Tensor,
               state_out_slots: torch.Tensor | None = None) -> ForwardBatch:
        """The batch of the round's ``forward``-th forward (:class:`RoundPlan`) over ``b`` lanes."""
        tokens, ctx = plan.token_rows[forward], plan.context_rows[forward]
        t = (tokens.stop - tokens.start) // b
        return make_batch(input_ids=ids.reshape(-1), positions=rows.rope_positions[tokens],
                          cu_seqlens=self._cu[t][:b + 1], max_seqlen=t, context_lens=rows.positions32[ctx],
                          block_tables=self.block_tables[:b], slot_mapping=rows.slots[tokens],
                          state_slots=self._views[b][1],
                          state_out_slots=state_out_slots)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        (lanes, _, out_slots), t, plan = self._views[b], self.t, self._plans[b]
        torch.index_select(self.lane_block_tables, 0, lanes, out=self.block_tables[:b])
        rows = round_rows(lanes, self.start, self.accepted, self.rope_delta, self.block_tables[:b],
                          self.cache.page_size, plan.lane, plan.after, plan.offset, plan.tokens)
        tokens, acc = self.tokens[lanes], self.accepted[lanes]
        # Catch-up: all K+1 pairs of the last verification write their MTP K/V; the draft comes from pair a
        # alone, so only its row goes through the LM head (b rows, not b * (K+1): the head's GEMM grows with rows
        # past 8).
        h = self.head.advance(self.hidden[lanes].reshape(b * t, -1), tokens.reshape(-1),
                              self._batch(b, rows, plan, 0, tokens), self.mtp_cache)
        h = h.view(b, t, -1).gather(1, acc[:, None, None].expand(b, 1, h.shape[-1])).squeeze(1)
        draft = self._draft(h)
        drafts = [draft]
        for i in range(1, self.k):
            h = self.head.advance(h, draft, self._batch(b, rows, plan, i, draft), self.mtp_cache)
            draft = self._draft(h)
            drafts.append(draft)
        drafts_t = torch.stack(drafts, 1)
        n = rows.positions[plan.first_verified]  # position of x_n, the last committed token (not yet computed)
        if self.propose is not None:
            drafts_t = self.propose(lanes, n, drafts_t)
        ids = torch.cat([tokens.gather(1, acc[:, None]), drafts_t], 1)
        batch = self._batch(b, rows, plan, self.k, ids, state_out_slots=out_slots)
        hidden = self.model(batch, self.cache)
        return drafts_t, self.model.logits(hidden), hidden, n

    def _draft(self, h: torch.Tensor) -> torch.Tensor:
        """The greedy draft after head states ``h [b, H]``: the argmax of the LM head, over the draft vocabulary
        where one is set (its rows only are read: a GEMM of ``len(draft_ids)`` rows, not the vocabulary's)."""
        if self.draft_rows is None:
            return self.model.logits(h)[:, :self.vocab_limit].argmax(-1)
        return self.draft_ids[F.linear(h, self.draft_rows).argmax(-1)]

    def _capture(self, b: int, pool: object) -> object:
        # Warm-up and capture run on lane 0, slot 0 and page 0: scratch that a real sequence resets.
        self.graphs[b], self.outputs[b] = capture(lambda: self._forward(b), pool)
        return self.graphs[b].pool()


def _even(n: int) -> int:
    return n + n % 2


class RoundPlan:
    """The rows of one round over ``b`` lanes (:mod:`ninfer.kernels.spec_rows`), forward after forward.

    Forward 0 is the catch-up over each lane's ``K + 1`` pairs, at positions ``start .. start + K``; forward
    ``i`` in ``1 .. K - 1`` the draft step at ``n + i - 1``; forward ``K`` the verification at ``n .. n + K``,
    where ``n = start + accepted + 1``. Token rows come first (``token_rows[f]`` slices them), then one row per
    lane and forward one past its last token (``context_rows[f]``: the context lengths), then ``n`` itself
    (``first_verified``).
    """

    def __init__(self, b: int, k: int, device: torch.device) -> None:
        t = k + 1
        forwards = [(0, range(t))] + [(1, range(i - 1, i)) for i in range(1, k)] + [(1, range(t))]
        plan: list[tuple[int, int, int]] = []
        self.token_rows, self.context_rows = [], []
        for after, steps in forwards:
            self.token_rows.append(self._add(plan, [(lane, after, j) for lane in range(b) for j in steps]))
        self.tokens = len(plan)
        for after, steps in forwards:
            self.context_rows.append(self._add(plan, [(lane, after, steps[-1] + 1) for lane in range(b)]))
        self.first_verified = self._add(plan, [(lane, 1, 0) for lane in range(b)])
        self.lane, self.after, self.offset = (torch.tensor(column, dtype=torch.long, device=device)
                                              for column in zip(*plan, strict=True))

    @staticmethod
    def _add(plan: list[tuple[int, int, int]], rows: list[tuple[int, int, int]]) -> slice:
        """Append ``rows`` and padding up to a multiple of four rows (lane 0's start: a real position, never read),
        so that every slice starts 16-byte aligned, int64 or int32, as fresh tensors do: the kernels specialise
        on their pointers' alignment, and the rounds then meet the variants the plain decode compiled."""
        first = len(plan)
        plan.extend(rows)
        plan.extend([(0, 0, 0)] * (-len(plan) % 4))
        return slice(first, first + len(rows))


def force_acceptance(spec: MTPSpeculator, n: int | None) -> None:
    """Benchmarks and tests: every round of ``spec`` accepts exactly ``n`` drafts, whatever the target samples
    (random weights accept next to none, so rounds of every acceptance count need this); ``None``: the real rule
    again. The committed tokens are then drafts the target did not choose: outputs are meaningless, timings not."""
    if n is None:
        spec.__dict__.pop("acceptance", None)
        return
    if not 0 <= n <= spec.k:
        raise ValueError(f"forced acceptance must be in 0..{spec.k} (the draft tokens), got {n}")

    def forced(sampled: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        return torch.full((drafts.shape[0],), n, dtype=torch.long, device=drafts.device)
    spec.acceptance = forced  # type: ignore[method-assign]
