"""Pausing resident requests when the KV pool runs dry, and resuming them later.

Admission reserves only what a request needs now (its prompt, or everything a paused request holds, plus
the next token) and a small growth margin; a decoding sequence reserves more pages as it grows. At the
start of each step every decoding request must be able to hold its next token: pages come from the free
pool, then from evicting prefix-cache checkpoints (least recently used), and only when both run out is
the most recently admitted resident request paused (LIFO, like vLLM's preemption), so the oldest requests
always make progress. A request alone in the engine always fits (admission clamps ``max_new_tokens`` to
the pool and the context), so pausing never deadlocks: at worst a request ends with ``"length"``.

A paused request goes back to the head of the wait queue, keeping its sampler lane (seed and counter:
the random stream continues where it stopped) and either

* a snapshot: its DeltaNet state slot and the KV pages of its computed tokens, copied to host memory
  (blocks of the runner's pinned host pool, given back on resume or cancel: see
  :mod:`ninfer.runtime.host_memory`); it resumes by copying them into freshly taken pages and a slot
  (asynchronous on a GPU), or
* nothing, when the snapshot would exceed the host budget (``EngineConfig.pause_host_bytes``): it
  resumes by prefilling its prompt and committed output tokens again ("recompute"), starting from the
  longest prefix-cache checkpoint of those tokens. The recomputed state is the same function of the same
  tokens, so greedy and seeded outputs are those of an uninterrupted run (up to the rounding of the
  prefill kernels against the decode kernels, as with the prefix cache).

Requests with media are snapshotted whatever the budget once their prompt is done: their media
embeddings are dropped after the prefill, so they could not be recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.runtime.model_runner import ModelRunner
from ninfer.runtime.prefix_cache import HostCopy
from ninfer.runtime.request import Request, Status
from ninfer.runtime.sampler import LaneState, Sampler
from ninfer.runtime.scheduler import Scheduler
from ninfer.runtime.speculative import MTPSpeculator


@dataclass
class PausedState:
    """What a paused request keeps while it waits (``Request.paused``)."""

    lane: LaneState  # the sampler's (seed, counter)
    cached_tokens: int  # prompt tokens the first admission took from the prefix cache (usage reports these)
    host: HostCopy | None  # the snapshot; None: resume by recompute
    spec: Any = None  # with a snapshot and speculative decoding: the lane's draft state (MTPSpeculator.save_lane)

    @property
    def nbytes(self) -> int:
        return self.host.nbytes if self.host is not None else 0


@dataclass
class PauseStats:
    pauses: int = 0
    resumes: int = 0
    snapshots: int = 0  # pauses that kept a host snapshot
    recomputes: int = 0  # pauses that will prefill their tokens again


@dataclass
class Pauser:
    scheduler: Scheduler
    runner: ModelRunner  # the device state a snapshot copies (its host cache) and the block tables resumes fill
    sampler: Sampler
    host_bytes_limit: int  # host memory for snapshots of paused requests (beyond it: recompute)
    spec: MTPSpeculator | None = None  # the engine's speculator, when it speculates
    stats: PauseStats = field(default_factory=PauseStats)

    @property
    def host_bytes(self) -> int:
        """Host memory the snapshots of paused requests hold now (also safe off the engine thread, where
        metrics may read it: the queue is copied in one step and each record read once)."""
        states = [r.paused for r in list(self.scheduler.waiting)]
        return sum(s.nbytes for s in states if s is not None)

    def make_room(self) -> None:
        """Reserve, for every decoding request (oldest first), the pages of its next ``1 + lookahead``
        tokens (the scheduler's lookahead: a speculative verification writes K tokens ahead), pausing the newest resident requests when free pages and cached prefixes run out.

        Plain bookkeeping while nothing is short: no device work and no host sync.
        """
        running, lookahead = self.scheduler.running, self.scheduler.lookahead
        for req in list(running):
            if req.status is not Status.RUNNING or not req.prefill_done:
                continue  # paused a moment ago, or prefilling inside its admission reservation
            upto = min(req.num_computed + 1 + lookahead, len(req.prompt_ids) + req.max_new_tokens + lookahead)
            while not self._grow(req, upto):
                victim = running[-1]
                self.pause(victim)
                if victim is req:
                    break

    def needs_room(self) -> bool:
        """Whether :meth:`make_room` would have to reserve pages beyond those free (evict cached prefixes or
        pause requests): a step still in flight must land before either (``ninfer.runtime.run_ahead``)."""
        running, lookahead = self.scheduler.running, self.scheduler.lookahead
        short = 0
        for req in running:
            if req.status is Status.RUNNING and req.prefill_done:
                upto = min(req.num_computed + 1 + lookahead, len(req.prompt_ids) + req.max_new_tokens + lookahead)
                short += max(0, self.scheduler.pages_for(upto) - len(req.pages) - req.reserved_pages)
        return short > self.scheduler.pages.num_available

    def pause(self, req: Request) -> None:
        """Snapshot (or mark for recompute) a resident request and send it back to the wait queue."""
        lane = self.sampler.lane_state(req)
        host = None
        if req.num_computed > 0 and (self._must_snapshot(req) or
                                     self.host_bytes + self._snapshot_bytes(req) <= self.host_bytes_limit):
            computed_pages = req.pages[: self.scheduler.pages_for(req.num_computed)]
            host = HostCopy(self.runner.host.save_slot(req.slot), self.runner.host.save_pages(computed_pages))
            self.stats.snapshots += 1
        else:
            req.num_computed = 0
            req.replay_until = req.total_tokens  # the last output token is fed too: its logits sample the next
            self.stats.recomputes += 1
        spec = self.spec.save_lane(req.lane) if self.spec is not None and host is not None else None
        req.paused = PausedState(lane, req.cached_tokens, host, spec)
        self.scheduler.pause(req)
        self.stats.pauses += 1

    def resume(self, req: Request) -> None:
        """After admission: restore the snapshot (or let the prefill recompute) and the sampler lane.
        The engine has already reset the slot or applied the request's prefix hit."""
        state, req.paused = req.paused, None
        assert state is not None
        if state.host is not None:
            assert not req.pages, "a snapshot resumes without shared prefix pages"
            self.scheduler.ensure_pages(req, req.num_computed)
            self.runner.set_pages(req.lane, req.pages)
            self.runner.host.restore_slot(req.slot, state.host.state)
            self.runner.host.restore_pages(req.pages, state.host.kv)
            state.host.release(self.runner.host)  # the restores hold the blocks until they complete (host_memory)
            if state.spec is not None:  # the next round's catch-up needs the last verification's states
                self.spec.restore_lane(req.lane, state.spec, req.rope_delta)
        req.cached_tokens = state.cached_tokens
        self.sampler.start(req, resume=state.lane)
        self.stats.resumes += 1

    def discard(self, req: Request) -> None:
        """Drop a paused request's snapshot (it finishes while waiting: cancelled), giving its host memory back."""
        if req.paused is not None and req.paused.host is not None:
            req.paused.host.release(self.runner.host)
        req.paused = None

    def _grow(self, req: Request, upto_tokens: int) -> bool:
        short = self.scheduler.pages_for(upto_tokens) - len(req.pages) - req.reserved_pages
        if short <= 0:
            return True
        if not self.scheduler.reserve_pages(short):
            return False
        req.reserved_pages += short
        return True

    def _snapshot_bytes(self, req: Request) -> int:
        return self.runner.host.host_nbytes(slot=True, pages=self.scheduler.pages_for(req.num_computed))

    @staticmethod
    def _must_snapshot(req: Request) -> bool:
        return req.prefill_done and bool(req.media_keys)
