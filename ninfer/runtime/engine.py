"""The engine: continuous batching of up to 8 sequences over one shared KV pool.

``step()`` is the whole loop: the scheduler admits and plans, the model runner executes the decode batch
(replayed from a CUDA graph on GPU) or, when prompt chunks are due, one forward over the decode rows
and the chunks together, the sampler picks tokens, and the postprocessor turns them into each request's
text events (its output processor decides when it stops) and ends requests. A plain decode step is left in
flight where it may (:mod:`~ninfer.runtime.run_ahead`): the next step launches before its tokens are read.

Failure isolation: whatever raises while one request is prepared (admission, its rows of a batch),
sampled or turned into text finishes that request alone with ``finish_reason="error"`` and the error
in ``RequestOutput.error``, its lane, pages and slots back in their pools; the rest of the batch goes
on. A failing batched forward fails the requests resident in that step the same way (their device
state may be half-written), and the engine keeps serving the others and new ones.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ninfer.models.mtp import MTPHead
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime import startup
from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.isolation import draw_or_isolate, prepare_each, sample_each
from ninfer.runtime.memory import MemoryPlan
from ninfer.runtime.model_runner import ModelRunner
from ninfer.runtime.output import OutputProcessor
from ninfer.runtime.pause import Pauser
from ninfer.runtime.pools import PagePool, SlotPool
from ninfer.runtime.postprocess import Postprocessor
from ninfer.runtime.prefix_cache import PrefixCache
from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.run_ahead import InFlight, may_run_ahead
from ninfer.runtime.sampler import Sampler
from ninfer.runtime.scheduler import Scheduler
from ninfer.runtime.speculative import MTPSpeculator, SpecStats, committed_tokens
from ninfer.runtime.stall_budget import StallBound, StallBudget
from ninfer.runtime.warm_start import marker_for

# Decode rows join a step's prompt chunks in one forward while their contexts are shorter than this:
# beyond it their attention (in the prefill kernel) costs more than the separate decode step saved.
MIXED_MAX_CONTEXT = 16384

log = logging.getLogger("ninfer.engine")


class Engine:
    def __init__(self, model: Qwen3_5TextModel, make_output: Callable[[Request], OutputProcessor],
                 config: EngineConfig, *, vocab_limit: int, mtp_head: MTPHead | None = None) -> None:
        if config.draft_tokens and mtp_head is None:
            raise ValueError("draft_tokens > 0 needs the checkpoint's MTP head (mtp_head=...)")
        self.config, self.make_output = config, make_output
        self.device = model.device
        self.warm_marker = marker_for(model, mtp_head, config)
        skip = self.warm_marker.skip_reason() if self.warm_marker is not None and config.warmup else None
        if skip is not None:
            startup.skip_dry_passes(skip)
        # The device side (memory plan, cache, block tables, decode graphs); then the bookkeeping of its pages and
        # slots, the scheduler that hands them out, and the collaborators that need the runner.
        self.runner = runner = ModelRunner(model, config, mtp_head=mtp_head)
        self.pages, self.slots = PagePool(runner.plan.num_pages), SlotPool(config.num_state_slots)
        self.prefix = PrefixCache(runner.cache, runner.host, self.pages, self.slots, config.page_size,
                                  config.checkpoint_interval, config.host_cache_bytes) if config.prefix_cache else None
        self.scheduler = Scheduler(max_concurrency=config.max_concurrency, max_context=config.max_context,
                                   page_size=config.page_size, prefill_chunk=config.prefill_chunk,
                                   pages=self.pages, slots=self.slots, max_pending=config.max_pending,
                                   prefix=self.prefix, lookahead=config.draft_tokens,
                                   pack_prefills=not config.draft_tokens,  # speculation prefills one prompt a step
                                   prefill_tokens_while_decoding=config.prefill_tokens_while_decoding,
                                   stall=self._stall_budget(config))
        self.sampler = Sampler(config.max_concurrency, model.config.vocab_size, vocab_limit, self.device,
                               max_rows=config.max_concurrency * (1 + (config.draft_tokens or 0)))
        self.spec = MTPSpeculator(runner, mtp_head, vocab_limit=vocab_limit) if config.draft_tokens else None
        self.pauser = Pauser(self.scheduler, runner, self.sampler, config.pause_host_bytes, self.spec)
        self.outputs: dict[str, OutputProcessor] = {}
        self.requests: dict[str, Request] = {}
        self.spec_totals = SpecStats()
        self.post = Postprocessor(scheduler=self.scheduler, sampler=self.sampler, pauser=self.pauser,
                                  prefix=self.prefix, requests=self.requests, outputs=self.outputs,
                                  spec_totals=self.spec_totals)
        self.on_admit: Callable[[Request], None] | None = None  # each admitted request, before its prefill runs
        # Called once a step's forward is queued on the device, before the host waits for its tokens: work
        # done then (the server's streaming) overlaps the device instead of delaying the next launch.
        self.on_launched: Callable[[], None] | None = None
        self.launches_async = self.device.type == "cuda"  # whether there is such a wait to overlap
        self.runs_ahead = config.decode_ahead and self.spec is None
        self.ahead: InFlight | None = None  # a decode step launched, its tokens not yet read (run_ahead)
        if config.warmup and self.device.type == "cuda":
            self.warm_up()

    @staticmethod
    def _stall_budget(config: EngineConfig) -> StallBudget | None:
        if config.max_decode_stall is None:
            return None
        return StallBudget(StallBound.parse(config.max_decode_stall), initial=config.prefill_tokens_while_decoding,
                           most=config.prefill_chunk)

    @property
    def model(self) -> Qwen3_5TextModel:
        return self.runner.model

    @property
    def plan(self) -> MemoryPlan:
        return self.runner.plan

    def warm_up(self) -> None:
        """Compile and autotune at start-up what serving will meet (:meth:`ModelRunner.warm_up`), on pages and a
        slot the pools lend for it, then the sampling kernel's variants (:meth:`Sampler.warm_up`). Those compile
        together in a dry pass first, as the runner's kernels do: one after another, their 14 variants took
        85 s of a cold 27B start (run 2026-12-03.10). A finished warm-up leaves this configuration's marker
        (:mod:`ninfer.runtime.warm_start`): the next start skips its dry passes."""
        startup.parallel_compile(lambda: self.sampler.warm_up(self.model))
        riders = self.config.max_concurrency if self.scheduler.pack_prefills else 0
        self.runner.warm_up(self.pages, self.slots, riders=riders,
                            while_decoding=self.scheduler.prefill_tokens_while_decoding,
                            draft=self.spec.warm_up_chunk if self.spec is not None else None)
        with startup.phase("warm-up"):
            self.sampler.warm_up(self.model)
        if self.scheduler.stall is not None and self.runner.chunk_graphs is not None:
            self.scheduler.stall.replays_chunks_of(self.runner.chunk_graphs.tokens)
        if self.warm_marker is not None:
            self.warm_marker.write()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raises AdmissionError (never runnable) or QueueFull (try later)."""
        if req.mm is not None:
            req.media_keys = req.mm.media_keys
        processor = self.make_output(req)  # before the scheduler holds the request: a failure leaves nothing behind
        if req.params.min_tokens:
            req.min_tokens_ids = processor.stop_ids
        req.think_end = processor.think_end_id
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self.outputs[req.request_id] = processor

    def cancel(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        return self.post.finish(req, "cancelled")

    supports_logprobs = True

    def is_idle(self) -> bool:
        """No request anywhere, and every page and slot free except those the prefix cache holds."""
        cached_pages, cached_slots = self.prefix.held() if self.prefix is not None else (0, 0)
        return (not self.has_work and not self.requests and self.pages.reserved == 0
                and self.pages.num_used == cached_pages and self.slots.num_slots - self.slots.num_free == cached_slots
                and len(self.scheduler.free_lanes) == self.config.max_concurrency)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns its events (a request's failure is one of them, never an exception)."""
        events: list[RequestOutput] = []
        started = time.perf_counter()
        try:
            shape = self._step(events)
            if self.scheduler.stall is not None and shape is not None:
                self.scheduler.stall.observe(time.perf_counter() - started, *shape)
        except Exception as err:  # a batched stage: what ran in it may be half-written, so its requests end
            self.ahead = None
            log.exception("engine step failed; ending the %d resident requests", len(self.scheduler.running))
            for req in list(self.scheduler.running):
                events.extend(self.post.fail(req, "the batched step", err, logged=True))
        return events

    def _step(self, events: list[RequestOutput]) -> tuple[int, int] | None:
        """The step's stages append their events to ``events`` as they go, so that the error events of requests
        failed early in the step are not lost when a later batched stage raises. Returns the step's prompt
        tokens and decoding sequences as planned (None: nothing ran), for the stall budget."""
        waiting = self.scheduler.waiting and self.scheduler.free_lanes  # without a free lane nothing is admitted
        if self.ahead is not None and (waiting or self.pauser.needs_room()
                                       or not all(r.prefill_done for r in self.scheduler.running)):
            prev, self.ahead = self.ahead, None  # admitting, prefilling and pausing need every token on the host
            prev.land(self.sampler, self.post.append, events)
        self.pauser.make_room()  # growing sequences first: pauses the newest resident requests if pages ran out
        for req in self.scheduler.admit():
            try:
                self._start(req)
            except Exception as err:
                events.extend(self.post.fail(req, "admission", err))
        plan = self.scheduler.plan()
        if not plan.decode and not plan.prefills:
            return None
        shape = plan.prefill_tokens, len(plan.decode)
        if plan.prefills and self.spec is None and plan.prefills[0][0].mm is None:
            # Decode rows ride along with the prompt chunks unless their contexts are long: the prefill
            # attention kernel gives a one-token query no split-KV parallelism.
            # Nor do they where the chunk replays its graph: the decode graph replays beside it.
            ride = (all(r.num_computed < MIXED_MAX_CONTEXT for r in plan.decode)
                    and not self.runner.takes_chunk_graph(plan.prefills, plan.checkpoints))
            if not ride:
                self._decode(plan.decode, events)
            self._mixed_step(plan.decode if ride else [], plan.prefills, plan.checkpoints, events)
            return shape
        if plan.decode and self.spec is not None:
            self._speculative_round(plan.decode, events)
        elif plan.decode:  # a prompt finishing below would join the next step with its token on the host
            self._decode(plan.decode, events, may_stay=not plan.prefills)
        for req, end in plan.prefills:  # one (speculation, media); see Scheduler.plan
            try:  # a forward of this request alone: its failure touches no other request's state
                events.extend(self._prefill(req, end))
            except Exception as err:
                events.extend(self.post.fail(req, "prefill", err))
        return shape

    def _start(self, req: Request) -> None:
        """An admitted request's state: prefix-cache hit or a reset slot, its pause snapshot, its sampler lane."""
        if req.prefix_hit is not None:
            self._resume_from_prefix(req)
        else:
            self.runner.cache.reset_slot(req.slot)
        if req.paused is not None:
            self.pauser.resume(req)  # its snapshot, or nothing (it prefills again); its sampler lane
        else:
            self.sampler.start(req)
        if self.spec is not None and req.spec_stats is None:
            req.spec_stats = SpecStats()
        if self.on_admit is not None:
            self.on_admit(req)

    def _prefill(self, req: Request, end: int) -> list[RequestOutput]:
        logits = self._prefill_logits(req, end)
        self._launched()
        self._maybe_checkpoint(req, logits is not None)
        if logits is None:
            return []
        tokens, logprobs = self.sampler.sample(logits, [req])
        if self.spec is not None:
            self.spec.begin(req, tokens[0])
        return self.post.append(req, tokens[0], logprobs[0])

    def _decode(self, reqs: list[Request], events: list[RequestOutput], may_stay: bool = False) -> None:
        """One decode step. A step still in flight (:mod:`~ninfer.runtime.run_ahead`) feeds this one its drawn
        tokens and lands only after this one is launched; this one stays in flight when its batch may and
        ``may_stay`` (no prompt finishes in this step)."""
        prev, self.ahead = self.ahead, None
        if prev is not None:  # a request whose token in flight is its last by length gets no row after it
            reqs = [r for r in reqs if len(r.output_ids) + 1 < r.max_new_tokens]
        slots = prepare_each(reqs, lambda r: self._slots_for(r, r.num_computed, r.num_computed + 1)[0],
                             "decode preparation", self.post.fail, events)
        reqs = [r for r, _ in slots]
        cur = logits = None
        if reqs:
            logits = self._decode_logits(reqs, [slot for _, slot in slots], prev.inputs_for(reqs) if prev else None)
            self._launched()
            try:
                cur = InFlight.launch(reqs, self.sampler.launch(logits, reqs))
            except Exception:  # sample_each below tries again and isolates the failing rows, after prev lands
                pass
        if prev is not None:
            prev.land(self.sampler, self.post.append, events)
        if cur is None and reqs:
            for req, token, lp in sample_each(self.sampler, logits, reqs, self.post.fail, events):
                events.extend(self.post.append(req, token, lp))
        elif cur is not None and may_stay and self.runs_ahead and may_run_ahead(cur.reqs):
            self.ahead = cur
        elif cur is not None:
            cur.land(self.sampler, self.post.append, events)

    def _mixed_step(self, decode: list[Request], prefills: list[tuple[Request, int]], marks: dict[str, int],
                    events: list[RequestOutput]) -> None:
        """One forward over ``decode`` (one new token each) and the prompt chunks ``prefills`` (request, end):
        the weights are read once instead of twice (a decode graph, then the prefill); eager, as every prefill.
        ``marks``: prompt positions inside the chunks whose state the forward also keeps for the prefix cache.
        Each request's rows are prepared on its own: one that cannot be is failed and left out."""
        decode_rows = prepare_each(decode, lambda r: (self._slots_for(r, r.num_computed, r.num_computed + 1),
                                                      [r.output_ids[-1]]), "decode preparation", self.post.fail, events)
        chunk_rows = prepare_each(prefills, lambda item: (self._slots_for(item[0], item[0].num_computed, item[1]),
                                                          item[0].tokens(item[0].num_computed, item[1])),
                                  "prefill preparation", self.post.fail, events)
        decode, prefills = [r for r, _ in decode_rows], [item for item, _ in chunk_rows]
        if not decode and not prefills:
            return
        checkpoints = self.prefix.forward_checkpoints(prefills, marks, len(decode)) if marks else []
        try:
            hidden, cu = self.runner.mixed(decode_rows, chunk_rows, checkpoints)
        except Exception:
            for *_, slot in checkpoints:  # reserved for this forward's checkpoints, which will not exist
                self.slots.release(slot)
            raise
        for req in decode:
            req.num_computed += 1
        for _, req, _, r, slot in checkpoints:  # num_computed is still the chunk's start
            self.prefix.adopt(req.tokens(0, req.num_computed + r), slot, req.pages, req.media_keys)
        rows, sampled = list(range(len(decode))), list(decode)  # the rows that sample a token, in order
        for i, (req, end) in enumerate(prefills, start=len(decode)):
            req.num_computed = end
            done = end >= req.prefill_target
            self._maybe_checkpoint(req, done)
            if done:
                rows.append(cu[i + 1] - 1)
                sampled.append(req)
        logits = self.runner.logits(hidden[torch.tensor(rows, device=self.device)]) if sampled else None
        self._launched()
        if logits is not None:
            for req, token, lp in sample_each(self.sampler, logits, sampled, self.post.fail, events):
                events.extend(self.post.append(req, token, lp))

    def _maybe_checkpoint(self, req: Request, prompt_done: bool) -> None:
        """After a prompt chunk that stopped at a checkpoint mark, let the prefix cache keep the state."""
        if self.prefix is not None and not prompt_done and self.scheduler.is_checkpoint_mark(req, req.num_computed):
            self.prefix.insert(req.tokens(0, req.num_computed), req.slot, req.pages, req.media_keys)

    def run_until_done(self) -> list[RequestOutput]:
        events = []
        while self.has_work:
            events.extend(self.step())
        return events

    # -- prefix cache -------------------------------------------------------------------------
    def _resume_from_prefix(self, req: Request) -> None:
        """Start from a checkpoint: shared pages are already the request's; copy the state and the
        partly filled last page (copy-on-write), and skip the cached tokens."""
        hit, ps = req.prefix_hit, self.config.page_size
        self.prefix.record_hit(hit)
        req.num_computed = req.cached_tokens = hit.length
        req.prefix_hit = None
        if hit.checkpoint.kv_on_host:  # the KV comes back from host memory into the sequence's own pages
            self._slots_for(req, 0, hit.length)
            self.prefix.restore(hit.checkpoint, req.slot, req.pages)
            return
        self.prefix.restore(hit.checkpoint, req.slot)  # the state, from its slot or host memory
        if req.pages:
            self.runner.set_pages(req.lane, req.pages)
        if hit.length % ps:
            self._slots_for(req, hit.length, hit.length + 1)  # takes the page that holds position hit.length
            self.runner.cache.copy_page(hit.checkpoint.pages[hit.length // ps], req.pages[-1])

    # -- model calls --------------------------------------------------------------------------
    def _slots_for(self, req: Request, start: int, end: int) -> list[int]:
        """The KV slots of positions ``[start, end)``, taking the request's reserved pages that they need."""
        new_pages = self.scheduler.ensure_pages(req, end)
        if new_pages:
            self.runner.set_pages(req.lane, new_pages, first=len(req.pages) - len(new_pages))
        return self.runner.slot_mapping(req.pages, start, end)

    def _decode_logits(self, reqs: list[Request], slot_mapping: list[int],
                       ids: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.runner.decode(reqs, slot_mapping, ids)
        for r in reqs:
            r.num_computed += 1
        return logits

    def _prefill_logits(self, req: Request, end: int) -> torch.Tensor | None:
        start = req.num_computed
        hidden, batch = self.runner.prefill(req, start, end, self._slots_for(req, start, end))
        if self.spec is not None:
            self.spec.prefill(req, hidden, batch, start, end)
        req.num_computed = end
        if end < req.prefill_target:  # a paused request's replay ends with its last output token
            return None
        req.mm = None  # the media embeddings are no longer needed once the prompt is in the cache
        return self.runner.logits(hidden[-1:])

    def _speculative_round(self, reqs: list[Request], events: list[RequestOutput]) -> None:
        """Draft K tokens per sequence, verify them in one target step, commit the accepted run."""
        spec, t = self.spec, self.spec.t
        # The verification writes KV at positions n .. n + K.
        reqs = [r for r, _ in prepare_each(reqs, lambda r: self._slots_for(r, r.num_computed, r.num_computed + t),
                                           "speculation preparation", self.post.fail, events)]
        if not reqs:
            return
        drafts, logits, hidden, n = spec.run(reqs)
        self._launched()
        draw = draw_or_isolate(self.sampler, logits, reqs, drafts, self.post.fail, events)
        if draw is None:
            return
        sampled = draw.out.token_ids.view(len(reqs), t)
        accepted = spec.acceptance(sampled, drafts)
        committed = committed_tokens(sampled, drafts, accepted)
        spec.advance(reqs, hidden, committed, accepted, n)
        self.sampler.commit(draw, accepted)
        rows = torch.cat([committed, accepted[:, None]], 1).tolist()  # the round's one host sync
        tokens = [row[:row[-1] + 1] for row in rows]
        logprobs = self.sampler.logprobs(draw, tokens) if draw.want_logprobs else [[None] * len(x) for x in tokens]
        for req, toks, lps in zip(reqs, tokens, logprobs):
            req.spec_stats.record(spec.k, len(toks) - 1)
            n0, slots, outs = req.num_computed, [req.slot, *req.spare_slots], list(req.spare_slots)
            for i, (tok, lp) in enumerate(zip(toks, lps)):
                # After committing token i, x_n .. (token i - 1) are computed and the state is the
                # slot written after verify token i: rolling back is choosing that slot.
                req.num_computed = n0 + i + 1
                req.slot, req.spare_slots = outs[i], [s for s in slots if s != outs[i]]
                events.extend(self.post.append(req, tok, lp))
                if req.status == Status.FINISHED:
                    break

    def _launched(self) -> None:
        if self.on_launched is not None:
            self.on_launched()
