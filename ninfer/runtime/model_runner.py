"""The model runner: the device side of the engine's step.

The scheduler decides what a step computes; the runner executes it. It owns what the forwards read and
write: the memory plan, the KV pages and state slots (:class:`~ninfer.models.cache.ModelCache`) and their
host copies (:class:`~ninfer.runtime.host_cache.HostCache`), the lanes' block tables (the runner is their
one writer: :meth:`ModelRunner.set_pages`, :meth:`ModelRunner.clear`), the CUDA graphs of the decode step,
the start-up warm-up, and the batches of the engine's forwards (all through
:func:`~ninfer.models.batch.make_batch`). It reports the kernels' tuner state its forwards use
(:mod:`ninfer.kernels.tuning`). The speculator and the pauser take the runner at construction.

Runner methods never change a request: the engine moves ``num_computed`` and the outputs on.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Hashable

import torch

from ninfer.kernels.attention.decode import DECODE_MAX_TOKENS
from ninfer.kernels.attention.prefill import launch_variant
from ninfer.kernels.conv import CONV_SHORT_TILE
from ninfer.kernels.deltanet import CHUNK, RECURRENT_MAX_SEQLEN, chunked_batch_sizes
from ninfer.kernels.tuning import TunerState, default_tuner
from ninfer.models.batch import ForwardBatch, make_batch
from ninfer.models.cache import ModelCache
from ninfer.models.mtp import MTPHead
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.quant.linear import use_kernel_layouts_
from ninfer.runtime import startup
from ninfer.runtime.chunk_graphs import ChunkGraphs, chunk_graph_tokens
from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.graphs import DecodeGraphs
from ninfer.runtime.host_cache import HostCache
from ninfer.runtime.memory import MemoryPlan, dequant_workspace_bytes, plan_memory
from ninfer.runtime.pools import PagePool, SlotPool
from ninfer.runtime.request import Request

log = logging.getLogger("ninfer.runtime")

# A mixed step's rows: decode ``(request, (kv slots, [token]))``, prompt chunks ``((request, end), (kv slots,
# tokens))``, and in-forward checkpoints ``(index in the batch, request, first packed row, tokens before the
# mark, target slot)`` (:meth:`ninfer.runtime.prefix_cache.PrefixCache.forward_checkpoints`).
DecodeRow = tuple[Request, tuple[list[int], list[int]]]
ChunkRow = tuple[tuple[Request, int], tuple[list[int], list[int]]]
ForwardCheckpoint = tuple[int, Request, int, int, int]


class ModelRunner:
    def __init__(self, model: Qwen3_5TextModel, config: EngineConfig, *, mtp_head: MTPHead | None = None) -> None:
        self.model, self.config = model, config
        self.device = model.device
        if self.device.type == "cuda":  # int4 projections into the register decode's layout, before any kernel
            use_kernel_layouts_(model, mtp_head)
        self.plan: MemoryPlan = plan_memory(model.config, config, self.device, model.dtype,
                                            dequant_workspace_bytes([model, mtp_head], model.dtype))
        self.cache = ModelCache(model.config, num_pages=self.plan.num_pages, page_size=config.page_size,
                                num_slots=config.num_state_slots, device=self.device, dtype=model.dtype,
                                kv_dtype=config.kv_dtype, with_mtp=bool(config.draft_tokens))
        host_bytes = (config.host_cache_bytes if config.prefix_cache else 0) + config.pause_host_bytes  # both budgets
        self.host = HostCache(self.cache, limit=host_bytes, prepin=config.host_prepin_bytes)
        max_pages = -(-(config.max_context + config.draft_tokens) // config.page_size)
        # [lanes, max_pages]: row ``lane`` lists the KV pages of the sequence in that lane. Read by every
        # forward (and the graphs' replays); written only by set_pages / clear. Rows are padded to 16 entries:
        # a one-lane slice (a prompt prefilled alone) then starts 16-byte aligned in every lane, as warm-up's
        # lane 0 does; Triton compiles a kernel per pointer alignment, so an odd lane would compile after ready.
        max_pages = -(-max_pages // 16) * 16
        self.block_tables = torch.zeros(config.max_concurrency, max_pages, dtype=torch.int32, device=self.device)
        # Speculation captures its own round graphs (MTPSpeculator); plain decoding replays these.
        self.graphs: DecodeGraphs | None = None
        if not config.draft_tokens and config.cuda_graphs and self.device.type == "cuda":
            startup.parallel_compile(lambda: self._decode_passes(config.max_concurrency))
            self.graphs = DecodeGraphs(model, self.cache, self.block_tables, config.max_concurrency)
        self.chunk_graphs: ChunkGraphs | None = None  # captured after warm-up where enabled (warm_up)

    # -- block tables -------------------------------------------------------------------------
    @property
    def tuner(self) -> TunerState:
        """The kernels' tuner state that this runner's forwards use (its choices and timings, for reports): the
        process's, looked up now. The kernels find it without a parameter from inside the forward, and engines
        of one process share what was timed for their device (a second engine times nothing the first did)."""
        return default_tuner()

    def set_pages(self, lane: int, pages: list[int], first: int = 0) -> None:
        """Entries ``first ..`` of ``lane``'s block table become ``pages``."""
        table = self._host_inputs([pages], torch.int32)[0]  # pinned: the host does not wait for queued kernels
        self.block_tables[lane, first:first + len(pages)].copy_(table, non_blocking=True)

    def clear(self, lane: int) -> None:
        """Point every entry of ``lane``'s table at page 0 (the lane's pages went back to the pool)."""
        self.block_tables[lane].zero_()

    def slot_mapping(self, pages: list[int], start: int, end: int) -> list[int]:
        """The flat KV slots of token positions ``[start, end)`` of a sequence holding ``pages``."""
        ps = self.config.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    # -- forwards -----------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def decode(self, reqs: list[Request], slot_mapping: list[int], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, V]`` of one new token per request at ``num_computed``: its last output token, or ``ids``
        (on the device: the tokens a step still in flight drew), from a CUDA graph's replay where there is one (its
        buffer: valid until the next replay). The host's inputs travel from pinned memory, so nothing here waits
        for the kernels already queued."""
        pos = [r.num_computed for r in reqs]
        b = len(reqs)
        rope = [p + r.rope_delta for r, p in zip(reqs, pos)]
        host = self._host_inputs([[r.output_ids[-1] for r in reqs] if ids is None else [0] * b, rope, rope, rope,
                                  [r.lane for r in reqs], [r.slot for r in reqs], slot_mapping], torch.long)
        context = self._host_inputs([[p + 1 for p in pos]], torch.int32)[0]
        ids = host[0] if ids is None else ids
        positions, lanes, state_slots, slots = host[1:4], host[4], host[5], host[6]
        if self.graphs is not None:
            return self.graphs.run(ids, positions, context, slots, lanes, state_slots)
        batch = make_batch(input_ids=ids, positions=positions, seq_lens=[1] * b, context_lens=context,
                           block_tables=self.block_tables[lanes.to(self.device)], slot_mapping=slots,
                           state_slots=state_slots)
        return self.model.logits(self.model(batch, self.cache))

    def _host_inputs(self, rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """``rows`` as one host tensor, pinned on a GPU (the caching host allocator keeps it until the copies that
        read it have run), each row contiguous and of the dtype it is copied into: a copy that had to convert or
        gather first would go through pageable memory."""
        return torch.tensor(rows, dtype=dtype, pin_memory=self.device.type == "cuda")

    def prefill(self, req: Request, start: int, end: int,
                slot_mapping: list[int]) -> tuple[torch.Tensor, ForwardBatch]:
        """Hidden states ``[end - start, H]`` of prompt tokens ``[start, end)`` of one request (media: 3-axis
        positions and vision features in place of pad embeddings), and the batch that computed them."""
        embeds = None
        if req.mm is not None:
            positions, embeds = req.mm.chunk(self.model, start, end)
        else:
            positions = torch.arange(start, end, device=self.device).expand(3, end - start)
        batch = make_batch(input_ids=req.tokens(start, end), positions=positions, seq_lens=[end - start],
                           context_lens=[end], block_tables=self.block_tables[req.lane:req.lane + 1],
                           slot_mapping=slot_mapping, state_slots=[req.slot])
        return self.model(batch, self.cache, inputs_embeds=embeds), batch

    def mixed(self, decode: list[DecodeRow], chunks: list[ChunkRow],
              checkpoints: list[ForwardCheckpoint]) -> tuple[torch.Tensor, list[int]]:
        """One forward over decode rows (one new token each, at ``num_computed``) and prompt chunks (request,
        end: tokens ``[num_computed, end)``) packed in that order; also writes the state at each checkpoint.
        Returns the hidden states ``[N, H]`` and the packed offsets ``cu_seqlens`` (host ints).
        A step that :meth:`takes_chunk_graph` and writes no checkpoint replays the chunk graph."""
        if not decode and self.takes_chunk_graph([item for item, _ in chunks], checkpoints):
            ((req, end), (row_slots, row_ids)), = chunks
            hidden = self.chunk_graphs.run(torch.tensor(row_ids, dtype=torch.long), req.num_computed,
                                           torch.tensor(row_slots, dtype=torch.long), req.lane, req.slot)
            return hidden, [0, end - req.num_computed]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        context: list[int] = []
        for req, (row_slots, row_ids) in decode:
            p = req.num_computed
            slots += row_slots
            ids += row_ids
            positions.append(p + req.rope_delta)
            lengths.append(1)
            context.append(p + 1)
        for (req, end), (row_slots, row_ids) in chunks:
            start = req.num_computed
            slots += row_slots
            ids += row_ids
            positions += range(start, end)
            lengths.append(end - start)
            context.append(end)
        reqs = [r for r, _ in decode] + [req for (req, _), _ in chunks]
        lanes = torch.tensor([r.lane for r in reqs], dtype=torch.long, device=self.device)
        marks: tuple[tuple[int, int, int, int], ...] = ()
        offsets = targets = None
        if checkpoints:
            offsets, targets = [0] * len(reqs), [0] * len(reqs)
            for i, _, row, r, slot in checkpoints:
                offsets[i], targets[i] = r, slot
            marks = tuple((row, r, req.slot, slot) for _, req, row, r, slot in checkpoints)
        batch = make_batch(input_ids=ids, positions=positions, seq_lens=lengths, context_lens=context,
                           block_tables=self.block_tables[lanes], slot_mapping=slots,
                           state_slots=[r.slot for r in reqs], checkpoints=marks, ckpt_offsets=offsets,
                           ckpt_slots=targets)
        return self.model(batch, self.cache), [0, *itertools.accumulate(lengths)]

    # -- start-up -----------------------------------------------------------------------------
    @torch.inference_mode()
    @startup.timed("warm-up")
    def warm_up(self, pages: PagePool, slots: SlotPool, *, riders: int, while_decoding: int,
                draft: Callable[[torch.Tensor, ForwardBatch], None] | None = None) -> None:
        """Compile and autotune on CUDA what serving will meet: prefill one chunk of each length in
        :func:`warmup_chunk_lengths` as a one-sequence batch on scratch pages and a scratch state slot (given
        back after), up to the longest step: ``prefill_chunk`` tokens (nothing decodes), or the budget
        ``while_decoding`` plus ``riders``, the decode rows a mixed step adds (their GEMMs may reach the bucket
        above). A mixed or packed step of the same length takes the same attention kernel, split-KV or not
        (:func:`~ninfer.kernels.attention.prefill.default_prefill_splits` counts one sequence's programs).
        ``draft(hidden, batch)`` runs after each one-sequence chunk: the speculator's head over it
        (:meth:`MTPSpeculator.warm_up_chunk`), whose kernels meet the same length classes.

        Why: on a GPU the first chunk of a new length class costs seconds of compiling and benchmarking
        configs, and prompts meet new classes late (a short turn after long prompts, the 1-token chunk
        before an end-of-prompt checkpoint, the remainder up to a checkpoint interval). The passes run
        twice: first dry, their kernels compiled in parallel (:func:`startup.parallel_compile`), then for
        real, timing the tuners' candidates with nothing left to compile."""
        config, ps = self.config, self.config.page_size
        step = max(config.prefill_chunk, while_decoding + riders)
        longest = min(step, config.max_context - 1, pages.num_available * ps)
        if longest < 1 or slots.num_free == 0:
            return
        num_pages = -(-longest // ps)
        pages.reserve(num_pages)
        scratch, slot = [pages.take_reserved() for _ in range(num_pages)], slots.acquire()
        self.set_pages(0, scratch)
        slot_mapping = torch.tensor(self.slot_mapping(scratch, 0, longest), dtype=torch.long, device=self.device)
        startup.parallel_compile(lambda: self._warm_up_passes(longest, slot, slot_mapping, scratch, slots, draft))
        self._warm_up_passes(longest, slot, slot_mapping, scratch, slots, draft)
        self.cache.reset_slot(slot)
        self.clear(0)
        slots.release(slot)
        pages.release(scratch)
        tokens = chunk_graph_tokens(config)
        if self.graphs is not None and tokens:
            try:
                self.chunk_graphs = ChunkGraphs(self.model, self.cache, self.block_tables, tokens)
            except Exception as err:  # noqa: BLE001 (a failed capture must not stop the start: no graph)
                log.warning("no prompt-chunk graph (%s: %s): steps beside decodes run eagerly",
                            type(err).__name__, err)

    def takes_chunk_graph(self, chunks: list[tuple[Request, int]], checkpoints: Collection = ()) -> bool:
        """Whether a step of these prompt chunks (request, end) and no decode rows replays the chunk graph:
        one text chunk of the graph's length (:mod:`ninfer.runtime.chunk_graphs`) with no prefix-cache
        ``checkpoints`` to write (the graph writes none)."""
        if self.chunk_graphs is None or len(chunks) != 1 or checkpoints:
            return False
        req, end = chunks[0]
        return req.mm is None and end - req.num_computed == self.chunk_graphs.tokens

    def _warm_up_passes(self, longest: int, slot: int, slot_mapping: torch.Tensor, scratch: list[int],
                        slots: SlotPool, draft: Callable[[torch.Tensor, ForwardBatch], None] | None) -> None:
        """The warm-up's forwards: one chunk of each :func:`warmup_chunk_lengths` length (those of every prefill
        attention variant included: :func:`~ninfer.kernels.attention.prefill.launch_variant`), on lane 0's
        table and ``slot`` (state reset before each; ``draft`` after each), the short checkpointed chunks of
        :meth:`_warm_short_checkpoints`, then the packed prefills of :meth:`_warm_packed`.

        The chunks that take the prefill attention kernel end at ``longest`` (their keys reach back over the
        scratch pages) rather than start at 0: its tuning keys do not hold the context, and a chunk's best tile
        over a few keys (a fresh short prompt) is not its best over thousands (a chunk of a long prompt, such
        as those beside decodes), where attention costs most. The earlier positions' KV is whatever the pages
        hold: only the kernels' timing matters here."""
        heads = self.model.config.num_attention_heads
        for n in warmup_chunk_lengths(longest, lambda n: launch_variant(self.device, heads, n)):
            batch = self._scratch_prompt(n, slot, slot_mapping, start=longest - n if n > DECODE_MAX_TOKENS else 0)
            self.cache.reset_slot(slot)
            hidden = self.model(batch, self.cache)
            self.model.logits(hidden[-1:])
            if draft is not None:
                draft(hidden, batch)
        self.cache.reset_slot(slot)
        self._warm_short_checkpoints(slot, slot_mapping, slots)
        self._warm_packed(scratch, slot_mapping, slots)

    def _scratch_prompt(self, n: int, slot: int, slot_mapping: torch.Tensor, start: int = 0,
                        **checkpoint: object) -> ForwardBatch:
        """A one-sequence batch of ``n`` prompt tokens at positions ``start ..`` on lane 0's scratch pages and
        state ``slot`` (``checkpoint``: :func:`make_batch`'s checkpoint fields). Its KV slots are a fresh tensor,
        as serving's are: a slice at an odd offset would be a pointer Triton specialises apart."""
        dev, end = self.device, start + n
        return make_batch(input_ids=torch.zeros(n, dtype=torch.long, device=dev),
                          positions=torch.arange(start, end, device=dev), seq_lens=[n], context_lens=[end],
                          block_tables=self.block_tables[:1], slot_mapping=slot_mapping[start:end].clone(),
                          state_slots=[slot], **checkpoint)

    def _warm_short_checkpoints(self, slot: int, slot_mapping: torch.Tensor, slots: SlotPool) -> None:
        """A one-sequence chunk of the conv's short tile (:data:`CONV_SHORT_TILE` tokens) with a prefix-cache
        checkpoint inside, as a prompt's few tokens around a checkpoint mark: a checkpoint turns the one-launch
        DeltaNet decode kernel off, so the composed conv runs with a tile that neither decode nor the longer
        checkpointed chunks of :meth:`_warm_packed` use (a checkpoint lies strictly inside its chunk: such a
        chunk has 2 tokens or more, the short tile's lengths)."""
        n = CONV_SHORT_TILE
        if slots.num_free == 0 or n > slot_mapping.shape[0]:
            return
        ckpt_slot = slots.acquire()
        batch = self._scratch_prompt(n, slot, slot_mapping, checkpoints=((0, n // 2, slot, ckpt_slot),),
                                     ckpt_offsets=[n // 2], ckpt_slots=[ckpt_slot])
        for s in (slot, ckpt_slot):
            self.cache.reset_slot(s)
        self.model.logits(self.model(batch, self.cache)[-1:])
        for s in (slot, ckpt_slot):
            self.cache.reset_slot(s)
        slots.release(ckpt_slot)

    def _warm_packed(self, scratch: list[int], slot_mapping: torch.Tensor, slots: SlotPool) -> None:
        """Prefill packed batches as serving builds them (decode rows, then one prompt chunk long enough
        for the chunked DeltaNet kernels), of each sequence count in :func:`chunked_batch_sizes` up to the
        lanes, with and without a prefix-cache checkpoint: those kernels compile and tune per count class
        and per checkpoint flag, which one-sequence warm-up never meets. The rows share the scratch pages
        (their KV is never read back)."""
        dev, chunk = self.device, PACKED_WARMUP_CHUNK
        if slot_mapping.shape[0] < chunk:
            return
        for seqs in chunked_batch_sizes(min(self.block_tables.shape[0], slots.num_free - 1)):
            taken = [slots.acquire() for _ in range(seqs + 1)]  # the last one takes the checkpoint
            own, ckpt_slot = taken[:-1], taken[-1]
            for lane in range(seqs):
                self.set_pages(lane, scratch)
            lengths = [1] * (seqs - 1) + [chunk]
            positions = [0] * (seqs - 1) + list(range(chunk))
            mapping = torch.cat([slot_mapping[:1].expand(seqs - 1), slot_mapping[:chunk]])
            for checkpoint in (False, True):
                marks = ((seqs - 1, chunk // 2, own[-1], ckpt_slot),) if checkpoint else ()
                offsets = [0] * (seqs - 1) + [chunk // 2] if checkpoint else None
                targets = [0] * (seqs - 1) + [ckpt_slot] if checkpoint else None
                batch = make_batch(input_ids=torch.zeros(seqs - 1 + chunk, dtype=torch.long, device=dev),
                                   positions=positions, seq_lens=lengths, context_lens=lengths,
                                   block_tables=self.block_tables[:seqs], slot_mapping=mapping, state_slots=own,
                                   checkpoints=marks, ckpt_offsets=offsets, ckpt_slots=targets)
                for s in taken:
                    self.cache.reset_slot(s)
                self.model.logits(self.model(batch, self.cache)[-1:])
            for s in taken:
                self.cache.reset_slot(s)
                slots.release(s)
            for lane in range(1, seqs):
                self.clear(lane)

    @torch.inference_mode()
    def _decode_passes(self, max_batch: int) -> None:
        """The decode forwards the graphs capture (:class:`DecodeGraphs`, batch sizes ``max_batch .. 1``, the
        same batch layout on scratch page 0 and slot 0: slices of ``max_batch`` buffers, so that strides
        specialise the kernels alike), for the parallel compile's dry pass before them."""
        long = dict(dtype=torch.long, device=self.device)
        ids, slots, positions = (torch.zeros(max_batch, **long), torch.zeros(max_batch, **long),
                                 torch.zeros(3, max_batch, **long))
        context = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        tables = torch.zeros_like(self.block_tables)
        for b in range(max_batch, 0, -1):
            batch = make_batch(input_ids=ids[:b], positions=positions[:, :b], cu_seqlens=cu_seqlens[:b + 1],
                               max_seqlen=1, context_lens=context[:b], block_tables=tables[:b],
                               slot_mapping=slots[:b], state_slots=slots[:b])
            self.model.logits(self.model(batch, self.cache))


PACKED_WARMUP_CHUNK = 2 * CHUNK + 3  # a prompt chunk of two full DeltaNet chunks and a partial one


def warmup_chunk_lengths(longest: int, variant: Callable[[int], Hashable] | None = None) -> list[int]:
    """Prefill chunk lengths (up to ``longest``) that reach every autotune key one prompt's chunks can:
    each length the short-chunk kernels take (decode attention sizes its tile by the length; recurrent
    DeltaNet) and each power of two, since prefill attention (``tune_len``), quantized GEMMs (M bucket) and
    MoE GEMMs (``tune_m``) tune once per power-of-two bucket; ``longest`` reaches the bucket above it.
    ``variant(n)``: a prefill attention launch's variant at ``n`` tokens; the shortest length of each variant
    the lengths above miss joins them (its classes follow the GPU's SM count, not powers of two)."""
    short = max(DECODE_MAX_TOKENS, RECURRENT_MAX_SEQLEN)
    buckets = [1 << i for i in range(longest.bit_length())]
    # and one length off a multiple of 16 in each bucket above the short ones: Triton compiles a kernel
    # once for integer arguments divisible by 16 and once for the rest, with the bucket's tuned config
    uneven = [b - 1 for b in buckets if b - 1 > short] + [longest - 1]
    lengths = {n for n in {*range(1, short + 1), *buckets, *uneven, longest} if n <= longest}
    if variant is not None:
        seen = {variant(n) for n in lengths if n > DECODE_MAX_TOKENS}
        for n in range(DECODE_MAX_TOKENS + 1, longest + 1):
            v = variant(n)
            if v not in seen:
                seen.add(v)
                lengths.add(n)
    return sorted(lengths)
