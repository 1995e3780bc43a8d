"""A CUDA graph of one prompt chunk of a fixed length: the steps that prefill beside decoding sequences.

A step that prefills a chunk beside decodes runs eagerly, and on the 27B its ~1,300 launches keep the host busy
for 100-150 ms whatever the chunk's length (run 2026-12-03.18: 52 ms of kernels in a 147 ms step), so the
decodes' tokens wait that long. The runner can capture the forward of one text chunk of exactly
``prefill_tokens_while_decoding`` tokens; a step whose plan is one such chunk (no prefix-cache checkpoint inside
it) then replays the decode graph for the decoding sequences and this graph for the chunk: two replays instead
of ~1,300 launches, the weights read twice instead of once.

When: ``NINFER_CHUNK_GRAPHS`` unset (or ``auto``) captures it for budgets up to :data:`AUTO_MAX_TOKENS`, ``1``
for any budget, ``0`` never. On the H200 (27B ``int4``, 4 decodes beside a 32k prompt, run 2026-12-04.3) the
graph cut the decodes' ITL p99 at a 128-token budget from 13.1x to 6.8x their TPOT (11.1x at 256, against 18.3x
eagerly in run 2026-12-03.15; 6.2x at 128, 4.4x at 64 and 3.6x at 32 tokens with every GEMM path among the keys'
candidates, runs 2026-12-04.11 / .15); at the default 1,024-token budget a step is GPU-bound (~100 ms of
kernels), so the default stays eager. Packing the decode rows into this graph (one replay a step) was slower at
32 tokens (run 2026-12-04.16): the register decode reads the weights once per 32 rows either way, and the decode
rows then take the prefill kernels.

Everything the chunk varies lives in static buffers, as in :class:`~ninfer.runtime.graphs.DecodeGraphs`: its
token ids, positions, context length, KV slots, lane (which selects the row of the lane block table) and state
slot; the graph writes the chunk's hidden states into a static output. The quantized GEMMs of these sizes tune
apart among the paths a graph can hold (:func:`ninfer.kernels.quant_gemm.tune.graph_candidates`: the register
decodes, the tiled GEMM of :mod:`ninfer.kernels.quant_gemm.fragment_tiled`, and the dequantization path, whose
workspace the warm-up's prefill has grown to the largest weight by the time the graph is captured). The memory
plan's workspace counts the graph's activations (:func:`ninfer.runtime.memory.workspace_bytes`), which its pool
keeps.
"""
from __future__ import annotations

import os

import torch

from ninfer.models.batch import make_batch
from ninfer.models.cache import ModelCache
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.graphs import capture

ENV = "NINFER_CHUNK_GRAPHS"
AUTO_MAX_TOKENS = 256  # budgets whose eager steps are host-bound (measured at 128 and 256 tokens)
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def chunk_graphs_enabled(tokens: int) -> bool:
    """Whether a budget of ``tokens`` gets a chunk graph, by ``NINFER_CHUNK_GRAPHS`` (read now): on, off, or unset /
    ``auto``: up to :data:`AUTO_MAX_TOKENS`. Raises ``ValueError`` on another value."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value in ("", "auto"):
        return tokens <= AUTO_MAX_TOKENS
    raise ValueError(f"{ENV}={value!r}: expected 1, 0 or auto")


def chunk_graph_tokens(config: EngineConfig) -> int:
    """The length of the chunk graph an engine of ``config`` captures on CUDA (0: none): switched on, beside
    decode graphs (plain decoding, CUDA graphs on), for a budget shorter than a sequence. The runner captures
    it and the memory plan reserves its activations by this one rule."""
    tokens = config.prefill_tokens_while_decoding
    if not 0 < tokens < config.max_context or not config.cuda_graphs or config.draft_tokens:
        return 0
    return tokens if chunk_graphs_enabled(tokens) else 0


class ChunkGraphs:
    """The graph of one ``tokens``-token chunk of one sequence (``captured=False``: the same forward on the same
    static buffers, run eagerly; what the CPU tests check)."""

    def __init__(self, model: Qwen3_5TextModel, cache: ModelCache, lane_block_tables: torch.Tensor, tokens: int,
                 *, captured: bool = True) -> None:
        self.model, self.cache, self.lane_block_tables, self.tokens = model, cache, lane_block_tables, tokens
        device = lane_block_tables.device
        long = dict(dtype=torch.long, device=device)
        # The capture writes KV at slot 0 of page 0 and state at slot 0: scratch entries, reset when a real
        # sequence takes them (as the decode graphs' capture does).
        self.input_ids = torch.zeros(tokens, **long)
        self.offsets = torch.arange(tokens, **long).expand(3, tokens).contiguous()  # a run's positions less its start
        self.positions = self.offsets.clone()
        self.context_lens = torch.full((1,), tokens, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(tokens, **long)
        self.lane = torch.zeros(1, **long)
        self.state_slot = torch.zeros(1, **long)
        self.cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.block_table = torch.zeros(1, lane_block_tables.shape[1], dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if captured:
            self.graph, self.hidden = capture(self._forward)

    def _forward(self) -> torch.Tensor:
        torch.index_select(self.lane_block_tables, 0, self.lane, out=self.block_table)
        batch = make_batch(input_ids=self.input_ids, positions=self.positions, cu_seqlens=self.cu_seqlens,
                           max_seqlen=self.tokens, context_lens=self.context_lens, block_tables=self.block_table,
                           slot_mapping=self.slot_mapping, state_slots=self.state_slot)
        return self.model(batch, self.cache)

    def run(self, input_ids: torch.Tensor, start: int, slot_mapping: torch.Tensor, lane: int,
            state_slot: int) -> torch.Tensor:
        """Hidden states ``[tokens, H]`` of the chunk ``[start, start + tokens)`` of the sequence in ``lane``
        (its graph's output buffer: valid until the next run)."""
        end = start + self.tokens
        self.input_ids.copy_(input_ids, non_blocking=True)
        torch.add(self.offsets, start, out=self.positions)
        self.context_lens.fill_(end)
        self.slot_mapping.copy_(slot_mapping, non_blocking=True)
        self.lane.fill_(lane)
        self.state_slot.fill_(state_slot)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.hidden
