"""CUDA graphs of one prompt chunk of a fixed length beside ``b`` decode rows: the steps that prefill while
others decode.

A step that prefills a chunk beside decodes runs eagerly, and on the 27B its ~1,300 launches keep the host busy
for 100-150 ms whatever the chunk's length (run 2026-12-03.18: 52 ms of kernels in a 147 ms step), so the
decodes' tokens wait that long. The runner captures the forward of ``b`` decode rows (one token each) packed
before one text chunk of exactly ``prefill_tokens_while_decoding`` tokens, one graph per ``b`` from 0 to
``max_concurrency - 1``; a step whose plan is one such chunk (no prefix-cache checkpoint inside it) beside
decodes whose contexts are short enough to ride in a prefill forward (the engine's ``MIXED_MAX_CONTEXT``)
replays the graph of its ``b``: one replay instead of ~1,300 launches, the weights read once for the decodes and
the chunk. Decodes over longer contexts replay the decode graph and the chunk the graph of ``b = 0``: the
prefill attention gives a one-token query no split-KV parallelism.

When: ``NINFER_CHUNK_GRAPHS`` unset (or ``auto``) captures it for budgets up to :data:`AUTO_MAX_TOKENS`, ``1``
for any budget, ``0`` never. On the H200 (27B ``int4``, 4 decodes beside a 32k prompt, run 2026-12-04.3) the
graph cut the decodes' ITL p99 at a 128-token budget from 13.1x to 6.8x their TPOT (11.1x at 256, against 18.3x
eagerly in run 2026-12-03.15; 6.7x and 8.7x with the tiled GEMM and the dequantization path among the keys'
candidates, runs 2026-12-04.7 to .9; those runs replayed the decode graph, then the chunk's); at the default
1,024-token budget a step is GPU-bound (~100 ms of kernels), so the default stays eager.

Everything a step varies lives in static buffers, as in :class:`~ninfer.runtime.graphs.DecodeGraphs`: the rows'
token ids, positions and KV slots, the sequences' context lengths, lanes (which select rows of the lane block
table) and state slots; each graph writes its rows' hidden states into a static output. The quantized GEMMs of these sizes tune
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
    """The graphs of one ``tokens``-token chunk of one sequence after ``b`` decode rows, ``b = 0..max_decode``
    (``captured=False``: the same forwards on the same static buffers, run eagerly; what the CPU tests check)."""

    def __init__(self, model: Qwen3_5TextModel, cache: ModelCache, lane_block_tables: torch.Tensor, tokens: int,
                 max_decode: int = 0, *, captured: bool = True) -> None:
        self.model, self.cache, self.lane_block_tables = model, cache, lane_block_tables
        self.tokens, self.max_decode = tokens, max_decode
        device = lane_block_tables.device
        long = dict(dtype=torch.long, device=device)
        rows, seqs = max_decode + tokens, max_decode + 1
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(3, rows, **long)
        self.context_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(rows, **long)
        self.lanes = torch.zeros(seqs, **long)
        self.state_slots = torch.zeros(seqs, **long)
        self.block_tables = torch.zeros(seqs, lane_block_tables.shape[1], dtype=torch.int32, device=device)
        self.cu_seqlens = {b: torch.tensor([*range(b + 1), b + tokens], dtype=torch.int32, device=device)
                           for b in range(seqs)}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        pool = None
        # The captures write KV at slot 0 of page 0 and state at slot 0: scratch entries, reset when a real
        # sequence takes them (as the decode graphs' captures do). Largest first: the others reuse its pool.
        for b in range(max_decode, -1, -1) if captured else ():
            self.context_lens.fill_(1)
            self.context_lens[b] = tokens
            self.positions[:, b:b + tokens] = torch.arange(tokens, **long)
            self.graphs[b], self.hidden[b] = capture(lambda b=b: self._forward(b), pool)
            pool = self.graphs[b].pool()

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph of the chunk alone (None where nothing was captured)."""
        return self.graphs.get(0)

    def _forward(self, b: int) -> torch.Tensor:
        n = b + self.tokens
        torch.index_select(self.lane_block_tables, 0, self.lanes[:b + 1], out=self.block_tables[:b + 1])
        batch = make_batch(input_ids=self.input_ids[:n], positions=self.positions[:, :n],
                           cu_seqlens=self.cu_seqlens[b], max_seqlen=self.tokens, context_lens=self.context_lens[:b + 1],
                           block_tables=self.block_tables[:b + 1], slot_mapping=self.slot_mapping[:n],
                           state_slots=self.state_slots[:b + 1])
        return self.model(batch, self.cache)

    def fits(self, decode_rows: int) -> bool:
        return 0 <= decode_rows <= self.max_decode

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            slot_mapping: torch.Tensor, lanes: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[b + tokens, H]`` of ``b`` decode rows and then the chunk, packed as ``runner.mixed``
        packs them (host tensors: the rows' ids, text positions and KV slots; the ``b + 1`` sequences' context
        lengths, lanes and state slots): its graph's output buffer, valid until the next run."""
        n, b = input_ids.shape[0], lanes.shape[0] - 1
        if n != b + self.tokens or not self.fits(b):
            raise ValueError(f"a chunk graph holds up to {self.max_decode} decode rows and {self.tokens} chunk rows; "
                             f"got {b} and {n - b}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:, :n].copy_(positions.expand(3, n), non_blocking=True)
        self.context_lens[:b + 1].copy_(context_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.lanes[:b + 1].copy_(lanes, non_blocking=True)
        self.state_slots[:b + 1].copy_(state_slots, non_blocking=True)
        if b not in self.graphs:
            return self._forward(b)
        self.graphs[b].replay()
        return self.hidden[b]
