"""The engine's settings: lanes, context and KV capacity, chunking, prefix cache, speculation, host memory.

``ninfer.load(...)`` and ``ninfer serve`` map their arguments onto these fields; the engine reads them once.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 1
    max_context: int = 4096
    kv_capacity: int | str | None = None  # tokens; "auto" fills free memory; None = max_concurrency * max_context
    kv_dtype: str = "auto"
    prefill_chunk: int = 8192  # most prompt tokens per step: the chunk when no sequence is decoding
    prefill_tokens_while_decoding: int = 1024  # most prompt tokens per step while sequences decode (their stall)
    cuda_graphs: bool = True
    page_size: int = 64
    max_pending: int = 64
    prefix_cache: bool = True  # reuse KV pages + DeltaNet state checkpoints of earlier prompts
    checkpoint_slots: int = 4  # state slots beyond the lanes that hold prefix checkpoints
    checkpoint_interval: int = 4096  # also checkpoint every this many tokens of a long prompt
    host_cache_bytes: int = 0  # host memory that evicted checkpoints move to (0: evicted ones are dropped)
    draft_tokens: int = 0  # speculative decoding with the MTP head: K drafts per round (0: off)
    pause_host_bytes: int = 4 << 30  # host memory for snapshots of paused requests (beyond it: recompute)
    host_prepin_bytes: int = 0  # host memory pinned at start-up for those copies (at most both budgets)
    warmup: bool = True  # on CUDA, compile and autotune for every prefill chunk length class at start-up

    @property
    def num_state_slots(self) -> int:
        per_lane = 1 + (self.draft_tokens + 1 if self.draft_tokens else 0)  # + per-token verify states
        return self.max_concurrency * per_lane + (self.checkpoint_slots if self.prefix_cache else 0)
