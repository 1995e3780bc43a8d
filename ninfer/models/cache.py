"""Device storage for decoding state: paged attention KV and DeltaNet state slots.

The model reads and writes this storage through a :class:`~ninfer.models.batch.ForwardBatch`;
who owns which page or slot is the runtime's business, not the model's.
"""
from __future__ import annotations

import torch

from ninfer.config import ModelConfig
from ninfer.kernels.attention import PagedKV
from ninfer.models.host_memory import HostPool, HostTensors, Layout, aligned, pow2_at_least

HOST_BLOCK_BYTES = 32 << 20  # host memory block of large models: a 27B state slot packs into 5, KV into 8-page ones


class ModelCache:
    """KV pages for every full-attention layer and conv/recurrent state slots for every DeltaNet layer.

    ``kv[i]``: :class:`PagedKV` pages ``[num_pages, page_size, kv_heads, head_dim]`` in ``kv_dtype``
    (``"auto"`` = the model dtype, ``"bf16"``, ``"fp8"``, ``"int8"``; see :mod:`ninfer.kernels.attention`);
    ``conv[i]``: ``[num_slots, conv_dim, kernel - 1]`` (the last pre-conv inputs) in the model dtype;
    ``recurrent[i]``: ``[num_slots, Hv, dk, dv]`` in fp32.

    ``with_mtp`` adds the MTP layer's K/V as ``kv[num_hidden_layers]`` (the index the layer would
    have after the decoder's): its entry for position ``t`` lives in the same page slot as the
    target's token ``t``, so page copies, host offload and prefix sharing carry it along.

    Host copies (:meth:`save_slot`, :meth:`save_pages`) live in the blocks of ``host``, a
    :class:`~ninfer.models.host_memory.HostPool` (pinned when the cache is on a GPU) holding at most
    ``host_limit`` bytes, ``host_prepin`` of them pinned at once; callers give the copies back with
    :meth:`release`.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        with_mtp: bool = False,
        host_limit: int = 0,
        host_prepin: int = 0,
        host_block_bytes: int | None = None,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.kv = {
            i: PagedKV.allocate(num_pages, page_size, config.num_key_value_heads, config.head_dim,
                                dtype=dtype, device=device, kv_dtype=kv_dtype)
            for i in (*config.attention_layers, *((config.num_hidden_layers,) if with_mtp else ()))
        }
        self.mtp_layer = config.num_hidden_layers if with_mtp else None
        conv_shape = (num_slots, config.conv_dim, config.linear_conv_kernel_dim - 1)
        rec_shape = (num_slots, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        self.conv = {i: torch.zeros(conv_shape, dtype=dtype, device=device) for i in config.deltanet_layers}
        self.recurrent = {i: torch.zeros(rec_shape, dtype=torch.float32, device=device) for i in config.deltanet_layers}
        self._init_host(host_block_bytes, host_limit)
        self.host.reserve(host_prepin)

    def _init_host(self, block_bytes: int | None, limit: int) -> None:
        """The host pool, and the layouts of a state copy and of one block of KV pages."""
        states, pages = self._states(), self._page_tensors()
        state_bytes = [aligned(s[0].numel() * s.element_size()) for s in states]
        page_bytes = sum(aligned(t[0].numel() * t.element_size()) for t in pages)
        if block_bytes is None:  # a small model's whole slot in one block; at least any state tensor and a page
            block_bytes = pow2_at_least(max(min(sum(state_bytes), HOST_BLOCK_BYTES), *state_bytes, page_bytes, 1))
        self.host = HostPool(block_bytes, pin=self.device.type == "cuda", limit=limit)
        self._state_layout = Layout.pack([(tuple(s.shape[1:]), s.dtype) for s in states], block_bytes)

        def page_layout(n: int) -> Layout:
            return Layout.pack([((n, *t.shape[1:]), t.dtype) for t in pages], block_bytes)

        per_block = block_bytes // max(page_bytes, 1)  # pages per block, less any that alignment pads out
        while per_block > 0 and page_layout(per_block).num_blocks > 1:
            per_block -= 1
        if per_block == 0:
            raise ValueError(f"a {page_bytes}-byte KV page does not fit a {block_bytes}-byte host block")
        self._page_layout = page_layout(per_block)
        self.pages_per_block = per_block

    def mtp_view(self) -> ModelCache:
        """The MTP layer's K/V as the ``kv[0]`` of a cache the MTP head reads (same tensors, no copy)."""
        assert self.mtp_layer is not None, "this cache was built without MTP storage"
        view = object.__new__(ModelCache)
        view.page_size, view.num_pages, view.num_slots = self.page_size, self.num_pages, 0
        view.kv, view.conv, view.recurrent, view.mtp_layer = {0: self.kv[self.mtp_layer]}, {}, {}, None
        return view

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page (every attention layer, scales included): copy-on-write of a shared page."""
        for kv in self.kv.values():
            for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
                if t is not None:
                    t[dst].copy_(t[src])

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the DeltaNet conv + recurrent state of every layer from one slot to another."""
        for state in self._states():
            state[dst].copy_(state[src])

    def save_slot(self, slot: int) -> HostTensors:
        """A host copy of one slot's state, in pool blocks (asynchronous on a GPU: see host_memory)."""
        saved = self.host.take(self._state_layout)
        for state, host in zip(self._states(), saved.tensors, strict=True):
            host.copy_(state[slot], non_blocking=True)
        self.host.record(saved)
        return saved

    def restore_slot(self, slot: int, saved: HostTensors) -> None:
        for state, host in zip(self._states(), saved.tensors, strict=True):
            state[slot].copy_(host, non_blocking=True)
        self.host.record(saved)

    def save_pages(self, pages: list[int]) -> HostTensors:
        """A host copy of some pages of every attention layer (k, v and scales), ``pages_per_block`` pages
        per pool block; ``rows`` is the number of pages."""
        tensors, per = self._page_tensors(), self.pages_per_block
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        saved = self.host.take(self._page_layout, repeat=-(-len(pages) // per), rows=len(pages))
        for i, tensor in enumerate(tensors):  # as bytes: index_select / index_copy_ lack fp8 kernels
            rows = tensor.view(torch.uint8).index_select(0, index)
            for c, start in enumerate(range(0, len(pages), per)):
                host = saved.tensors[c * len(tensors) + i].view(torch.uint8)
                host[: len(pages) - start].copy_(rows[start: start + per], non_blocking=True)
        self.host.record(saved)
        return saved

    def restore_pages(self, pages: list[int], saved: HostTensors) -> None:
        """Copy the first ``len(pages)`` saved pages into ``pages``."""
        tensors, per, n = self._page_tensors(), self.pages_per_block, len(pages)
        assert n <= saved.rows, "more pages than the copy holds"
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        for i, tensor in enumerate(tensors):
            data = tensor.view(torch.uint8)
            rows = torch.empty((n, *data.shape[1:]), dtype=torch.uint8, device=data.device)
            for c, start in enumerate(range(0, n, per)):
                host = saved.tensors[c * len(tensors) + i].view(torch.uint8)
                rows[start: start + per].copy_(host[: n - start], non_blocking=True)
            data.index_copy_(0, index, rows)
        self.host.record(saved)

    def host_nbytes(self, *, slot: bool = False, pages: int = 0) -> int:
        """Host memory (whole pool blocks) that :meth:`save_slot` (with ``slot``) and :meth:`save_pages`
        of ``pages`` pages take: what the callers' host budgets count."""
        page_blocks = self._page_layout.num_blocks * -(-pages // self.pages_per_block)
        blocks = (self._state_layout.num_blocks if slot else 0) + page_blocks
        return blocks * self.host.block_bytes

    def release(self, *saved: HostTensors | None) -> None:
        """Give host copies back to the pool once dropped (``None`` and copies already given back are skipped)."""
        for copy in saved:
            self.host.release(copy)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one state slot (every DeltaNet layer): what :meth:`save_slot` copies."""
        return sum(s[0].numel() * s.element_size() for s in self._states())

    @property
    def page_nbytes(self) -> int:
        """Bytes of one KV page (every attention layer, scales included): what :meth:`save_pages` copies per page."""
        return sum(t[0].numel() * t.element_size() for t in self._page_tensors())

    def _states(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    def _page_tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.kv.values() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]

    @property
    def device(self) -> torch.device:
        return next(iter((*self.conv.values(), *(kv.k for kv in self.kv.values())))).device

    def reset_slot(self, slot: int) -> None:
        """Zero a state slot so a new sequence starts from the empty state."""
        for state in self._states():
            state[slot].zero_()

