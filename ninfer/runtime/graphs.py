"""CUDA graphs of the decode step, one per exact batch size ``1..max_batch``.

Everything a step varies — token ids, positions, context lengths, KV slots, lanes (which select
rows of the lane block table) and state slots — lives in static device buffers that are graph
inputs; the graph computes the logits of every sequence into a static output.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ninfer.kernels.dispatch import graph_bound
from ninfer.models.batch import make_batch
from ninfer.models.cache import ModelCache
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime import startup

T = TypeVar("T")


@startup.timed("graph capture")
@torch.inference_mode()
def capture(fn: Callable[[], T], pool: object = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` once on a side stream (compiling and autotuning every kernel outside the capture, on the
    paths the capture takes: :func:`~ninfer.kernels.dispatch.graph_bound`), then capture it into a graph that
    shares ``pool``; returns the graph and ``fn``'s static outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), graph_bound():
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


class DecodeGraphs:
    def __init__(self, model: Qwen3_5TextModel, cache: ModelCache, lane_block_tables: torch.Tensor,
                 max_batch: int) -> None:
        self.model, self.cache, self.lane_block_tables = model, cache, lane_block_tables
        device = lane_block_tables.device
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(3, max_batch, **long)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_batch, **long)
        self.lanes = torch.zeros(max_batch, **long)
        self.state_slots = torch.zeros(max_batch, **long)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, lane_block_tables.shape[1], dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        # The decode step writes KV at slot_mapping and state at state_slots: point both at scratch
        # entries (page 0 offset 0, slot 0) that are reset when a real sequence takes them.
        for b in range(max_batch, 0, -1):  # largest first, so smaller graphs reuse its memory pool
            self._capture(b)

    def _forward(self, b: int) -> torch.Tensor:
        torch.index_select(self.lane_block_tables, 0, self.lanes[:b], out=self.block_tables[:b])
        batch = make_batch(
            input_ids=self.input_ids[:b], positions=self.positions[:, :b], cu_seqlens=self.cu_seqlens[:b + 1],
            max_seqlen=1, context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b], state_slots=self.state_slots[:b],
        )
        return self.model.logits(self.model(batch, self.cache))

    def _capture(self, b: int) -> None:
        self.graphs[b], self.logits[b] = capture(lambda: self._forward(b), self.pool)
        self.pool = self.graphs[b].pool()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            slot_mapping: torch.Tensor, lanes: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
        """Replay the graph for ``b = len(input_ids)``; returns its logits buffer ``[b, V]`` (valid until the next run)."""
        b = input_ids.shape[0]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:, :b].copy_(positions, non_blocking=True)
        self.context_lens[:b].copy_(context_lens, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.lanes[:b].copy_(lanes, non_blocking=True)
        self.state_slots[:b].copy_(state_slots, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b]
