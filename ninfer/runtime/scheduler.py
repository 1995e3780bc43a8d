"""Admission and step planning: which sequences decode and which prompt chunks prefill this step.

Up to ``max_concurrency`` sequences are resident (one lane and one state slot each). Every step
decodes all resident sequences whose prompt is done and prefills prompt tokens taken from the oldest
unfinished prompts in order (prompts that arrive together share a step), within a token budget:

* nothing decoding: ``prefill_chunk`` tokens (default 8192): one large chunk keeps the GPU busy (a
  1024-token chunk leaves it idle between launches; vLLM and SGLang default to 8192 on this class of GPU);
* sequences decoding: ``prefill_tokens_while_decoding`` (default 1024, at most ``prefill_chunk``): each of
  their steps waits for at most that many prompt tokens, so a long prompt never stalls decoding for
  more than one such chunk; with ``max_decode_stall`` the engine bounds such a step's time instead, and the
  token budget follows from measured step times (:mod:`ninfer.runtime.stall_budget`).

Admission reserves the pages a request needs now plus a growth margin (:meth:`Scheduler.admission_pages`);
sequences take more as they grow, and when the pool runs dry ``pause.Pauser`` sends the newest resident
request back to the head of the queue (:meth:`Scheduler.pause`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ninfer.runtime.pools import PagePool, SlotPool
from ninfer.runtime.prefix_cache import PrefixCache, prompt_end_mark
from ninfer.runtime.request import Request, Status
from ninfer.runtime.stall_budget import StallBudget

GROWTH_PAGES = 1  # pages reserved at admission beyond the next token: a sequence grows a while before asking


class AdmissionError(ValueError):
    """A request the engine can never run (too long for the context or the pool)."""


class QueueFull(RuntimeError):
    """The bounded wait queue is full; the caller may retry later."""


@dataclass
class StepPlan:
    decode: list[Request]
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, end): prompt [num_computed, end)
    # request id -> prompt position whose state the forward also keeps for the prefix cache (in-forward
    # checkpoint: the chunk goes on past it instead of ending there)
    checkpoints: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the step prefills (the chunks' lengths, before the step moves ``num_computed``)."""
        return sum(end - req.num_computed for req, end in self.prefills)


class Scheduler:
    def __init__(self, *, max_concurrency: int, max_context: int, page_size: int, prefill_chunk: int,
                 pages: PagePool, slots: SlotPool, max_pending: int = 64, prefix: PrefixCache | None = None,
                 lookahead: int = 0, pack_prefills: bool = True,
                 prefill_tokens_while_decoding: int | None = None, stall: StallBudget | None = None) -> None:
        if not 1 <= max_concurrency <= 8:
            raise ValueError(f"max_concurrency must be in 1..8, got {max_concurrency}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        decoding = prefill_chunk if prefill_tokens_while_decoding is None else prefill_tokens_while_decoding
        if decoding < 1:
            raise ValueError(f"prefill_tokens_while_decoding must be >= 1, got {decoding}")
        self.max_context = max_context
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens_while_decoding = min(decoding, prefill_chunk)
        self.stall = stall  # with a time bound: the budget beside decodes follows measured step times
        self.pack_prefills = pack_prefills  # off when speculating: the speculator's prefill hook takes one prompt
        self.pages, self.slots = pages, slots
        self.max_pending = max_pending
        self.prefix = prefix
        # Speculative decoding verifies `lookahead` tokens beyond the last committed one: their KV
        # needs pages, and each token's DeltaNet state a spare slot.
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_lanes: deque[int] = deque(range(max_concurrency))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, req: Request) -> None:
        """Validate and enqueue; raises :class:`AdmissionError` or :class:`QueueFull`."""
        n = len(req.prompt_ids)
        if n == 0:
            raise AdmissionError("the prompt is empty: at least one token is needed")
        if n >= self.max_context:
            raise AdmissionError(f"the prompt has {n} tokens but max_context is {self.max_context} "
                                 f"(room is needed for at least one generated token)")
        pool_tokens = self.pages.num_pages * self.page_size - self.lookahead
        if n >= pool_tokens:
            raise AdmissionError(f"the prompt has {n} tokens but the KV pool holds only {pool_tokens} tokens")
        # The sequence never grows past the context or the pool: the rest of the budget is "length".
        # So a request alone in the engine always fits, and pausing others for it cannot deadlock.
        req.max_new_tokens = min(req.max_new_tokens, self.max_context - n, pool_tokens - n)
        if len(self.waiting) >= self.max_pending:
            raise QueueFull(f"the wait queue is full ({self.max_pending} requests)")
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests (in FIFO order, paused ones first) into free lanes while their pages can be
        reserved. A request resuming from a snapshot (``num_computed > 0``) skips the prefix cache."""
        admitted = []
        while self.waiting and self.free_lanes:
            req = self.waiting[0]
            hit = None
            if self.prefix is not None and req.num_computed == 0:
                tokens = req.tokens(0, req.replay_until) if req.replay_until else req.prompt_ids
                hit = self.prefix.lookup(tokens, req.media_keys)
            shared = self.prefix.shared_pages(hit) if hit is not None else []
            need = self.admission_pages(req) - len(shared)
            slots = self._reserve(need)
            if slots is None:
                self.pages.release(shared)
                break  # head-of-line: later requests wait their turn rather than overtake
            self.waiting.popleft()
            req.reserved_pages, req.pages, req.prefix_hit = need, shared, hit
            req.lane, req.slot, req.spare_slots = self.free_lanes.popleft(), slots[0], slots[1:]
            req.status = Status.RUNNING
            req.admit_time = time.perf_counter()
            self.running.append(req)
            admitted.append(req)
        return admitted

    def admission_pages(self, req: Request) -> int:
        """Pages for everything the request holds now and its next token (plus the ``lookahead`` tokens a
        speculative verification writes), plus a growth margin, but never more than it can ever use: the
        rest it takes while it grows."""
        ceiling = self.pages_for(len(req.prompt_ids) + req.max_new_tokens + self.lookahead)
        return min(self.pages_for(req.total_tokens + 1 + self.lookahead) + GROWTH_PAGES, ceiling)

    def reserve_pages(self, pages: int) -> bool:
        """Reserve ``pages``, evicting cached prefixes while they are short."""
        while not self.pages.reserve(pages):
            if self.prefix is None or not self.prefix.evict_one():
                return False
        return True

    def _reserve(self, pages: int) -> list[int] | None:
        """Reserve ``pages`` and take the state slots of a sequence (one, plus ``lookahead + 1`` spares for
        speculative verification), evicting cached prefixes if needed; the slots or None."""
        if not self.reserve_pages(pages):
            return None
        want = 1 + (self.lookahead + 1 if self.lookahead else 0)
        while self.slots.num_free < want and self.prefix is not None and self.prefix.free_slot():
            pass
        if self.slots.num_free < want:
            self.pages.unreserve(pages)
            return None
        return [self.slots.acquire() for _ in range(want)]

    def prefill_budget(self, decoding: int) -> int:
        """Prompt tokens a step may prefill next to ``decoding`` decode rows (the module docstring)."""
        if not decoding:
            return self.prefill_chunk
        return self.stall.tokens() if self.stall is not None else self.prefill_tokens_while_decoding

    def plan(self) -> StepPlan:
        """Every prefilled sequence decodes; prompt chunks of the oldest unfinished prompts fill the step's
        :meth:`prefill_budget` (several short prompts that arrive together prefill in one step). With
        ``pack_prefills`` off, and for a prompt with media, a step prefills one chunk of one prompt."""
        decode = [r for r in self.running if r.prefill_done]
        prefills: list[tuple[Request, int]] = []
        checkpoints: dict[str, int] = {}
        budget = self.prefill_budget(len(decode))
        for req in self.running:
            if req.prefill_done:
                continue
            alone = req.mm is not None or not self.pack_prefills
            if budget <= 0 or (prefills and alone):
                break
            end = min(req.num_computed + budget, req.prefill_target)
            mark = self.checkpoint_after(req) if self.prefix is not None else None
            if mark is not None and mark < end:
                # A packed step's forward writes the state at its chunk's last mark itself; earlier marks,
                # and the one-prompt path (speculation, media), end the chunk there.
                later = self.checkpoint_after(req, mark)
                if alone or (later is not None and later < end):
                    end = mark
                else:
                    checkpoints[req.request_id] = mark
            prefills.append((req, end))
            budget -= end - req.num_computed
            if alone:
                break
        return StepPlan(decode, prefills, checkpoints)

    def checkpoint_after(self, req: Request, start: int | None = None) -> int | None:
        """The next prompt position beyond ``start`` (default: what is computed) where the prefix cache takes
        a checkpoint: every ``interval`` tokens, one token before the prompt's end so that a repeated prompt
        hits (:func:`prompt_end_mark`), and the request's own marks (chat turn boundaries)."""
        assert self.prefix is not None
        start, n = req.num_computed if start is None else start, len(req.prompt_ids)
        end = prompt_end_mark(n, req.checkpoint_marks)
        marks = [(start // self.prefix.interval + 1) * self.prefix.interval, *req.checkpoint_marks,
                 *([] if end is None else [end])]
        return min((m for m in marks if start < m < n), default=None)

    def is_checkpoint_mark(self, req: Request, pos: int) -> bool:
        """Whether prompt position ``pos`` is one of :meth:`checkpoint_after`'s marks."""
        assert self.prefix is not None
        return (pos % self.prefix.interval == 0 or pos in req.checkpoint_marks
                or pos == prompt_end_mark(len(req.prompt_ids), req.checkpoint_marks))

    def ensure_pages(self, req: Request, upto_tokens: int) -> list[int]:
        """Take reserved pages until the sequence can hold ``upto_tokens``; returns the new pages."""
        new = []
        while len(req.pages) * self.page_size < upto_tokens:
            assert req.reserved_pages > 0, "sequence outgrew its reservation"
            req.reserved_pages -= 1
            page = self.pages.take_reserved()
            req.pages.append(page)
            new.append(page)
        return new

    def pause(self, req: Request) -> None:
        """Send a resident request back to the head of the queue (the caller saved what resuming needs)."""
        self._release(req)
        req.status = Status.PAUSED
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Return a resident or waiting request's lane, slot, pages and reservation (or its host snapshot)."""
        if req in self.running:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            req.paused = None
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.release(req.pages)
        self.pages.unreserve(req.reserved_pages)
        req.pages, req.reserved_pages = [], 0
        assert req.lane is not None and req.slot is not None
        self.free_lanes.append(req.lane)
        for slot in (req.slot, *req.spare_slots):
            self.slots.release(slot)
        req.lane = req.slot = None
        req.spare_slots = []
