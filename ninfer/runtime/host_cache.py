"""Host copies of a model cache's state slots and KV pages: prefix-cache offloads and pause snapshots.

The device storage (:class:`~ninfer.models.cache.ModelCache`) is what the forward reads; copying parts of
it to host memory and back is the runtime's business. The copies live in blocks of a
:class:`~ninfer.runtime.host_memory.HostPool` (pinned when the cache is on a GPU; see that module for the
why, the block layout and the synchronization of asynchronous copies).
"""
from __future__ import annotations

import torch

from ninfer.models.cache import ModelCache
from ninfer.runtime.host_memory import HostPool, HostTensors, Layout, aligned, pow2_at_least

HOST_BLOCK_BYTES = 32 << 20  # host memory block of large models: a 27B state slot packs into 5, KV into 8-page ones


class HostCache:
    """Saves and restores of ``cache``'s slots and pages in the blocks of ``pool``, a :class:`HostPool`
    holding at most ``limit`` bytes, ``prepin`` of them pinned at once; callers give the copies back with
    :meth:`release`. ``block_bytes`` (default: sized from the cache) is the pool's block size."""

    def __init__(self, cache: ModelCache, *, limit: int = 0, prepin: int = 0, block_bytes: int | None = None) -> None:
        self.cache = cache
        states, pages = cache.state_tensors(), cache.page_tensors()
        state_bytes = [aligned(s[0].numel() * s.element_size()) for s in states]
        page_bytes = sum(aligned(t[0].numel() * t.element_size()) for t in pages)
        if block_bytes is None:  # a small model's whole slot in one block; at least any state tensor and a page
            block_bytes = pow2_at_least(max(min(sum(state_bytes), HOST_BLOCK_BYTES), *state_bytes, page_bytes, 1))
        self.pool = HostPool(block_bytes, pin=cache.device.type == "cuda", limit=limit)
        self.state_layout = Layout.pack([(tuple(s.shape[1:]), s.dtype) for s in states], block_bytes)

        def page_layout(n: int) -> Layout:
            return Layout.pack([((n, *t.shape[1:]), t.dtype) for t in pages], block_bytes)

        per_block = block_bytes // max(page_bytes, 1)  # pages per block, less any that alignment pads out
        while per_block > 0 and page_layout(per_block).num_blocks > 1:
            per_block -= 1
        if per_block == 0:
            raise ValueError(f"a {page_bytes}-byte KV page does not fit a {block_bytes}-byte host block")
        self.page_layout = page_layout(per_block)
        self.pages_per_block = per_block
        self.pool.reserve(prepin)

    def save_slot(self, slot: int) -> HostTensors:
        """A host copy of one slot's state, in pool blocks (asynchronous on a GPU: see host_memory)."""
        saved = self.pool.take(self.state_layout)
        for state, host in zip(self.cache.state_tensors(), saved.tensors, strict=True):
            host.copy_(state[slot], non_blocking=True)
        self.pool.record(saved)
        return saved

    def restore_slot(self, slot: int, saved: HostTensors) -> None:
        for state, host in zip(self.cache.state_tensors(), saved.tensors, strict=True):
            state[slot].copy_(host, non_blocking=True)
        self.pool.record(saved)

    def save_pages(self, pages: list[int]) -> HostTensors:
        """A host copy of some pages of every attention layer (k, v and scales), ``pages_per_block`` pages
        per pool block; ``rows`` is the number of pages."""
        tensors, per = self.cache.page_tensors(), self.pages_per_block
        index = torch.tensor(pages, dtype=torch.long, device=self.cache.device)
        saved = self.pool.take(self.page_layout, repeat=-(-len(pages) // per), rows=len(pages))
        for i, tensor in enumerate(tensors):  # as bytes: index_select / index_copy_ lack fp8 kernels
            rows = tensor.view(torch.uint8).index_select(0, index)
            for c, start in enumerate(range(0, len(pages), per)):
                host = saved.tensors[c * len(tensors) + i].view(torch.uint8)
                host[: len(pages) - start].copy_(rows[start: start + per], non_blocking=True)
        self.pool.record(saved)
        return saved

    def restore_pages(self, pages: list[int], saved: HostTensors) -> None:
        """Copy the first ``len(pages)`` saved pages into ``pages``."""
        tensors, per, n = self.cache.page_tensors(), self.pages_per_block, len(pages)
        assert n <= saved.rows, "more pages than the copy holds"
        index = torch.tensor(pages, dtype=torch.long, device=self.cache.device)
        for i, tensor in enumerate(tensors):
            data = tensor.view(torch.uint8)
            rows = torch.empty((n, *data.shape[1:]), dtype=torch.uint8, device=data.device)
            for c, start in enumerate(range(0, n, per)):
                host = saved.tensors[c * len(tensors) + i].view(torch.uint8)
                rows[start: start + per].copy_(host[: n - start], non_blocking=True)
            data.index_copy_(0, index, rows)
        self.pool.record(saved)

    def host_nbytes(self, *, slot: bool = False, pages: int = 0) -> int:
        """Host memory (whole pool blocks) that :meth:`save_slot` (with ``slot``) and :meth:`save_pages`
        of ``pages`` pages take: what the callers' host budgets count."""
        page_blocks = self.page_layout.num_blocks * -(-pages // self.pages_per_block)
        blocks = (self.state_layout.num_blocks if slot else 0) + page_blocks
        return blocks * self.pool.block_bytes

    def release(self, *saved: HostTensors | None) -> None:
        """Give host copies back to the pool once dropped (``None`` and copies already given back are skipped)."""
        for copy in saved:
            self.pool.release(copy)
