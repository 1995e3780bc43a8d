"""Device storage for decoding state: paged attention KV and DeltaNet state slots.

The model reads and writes this storage through a :class:`~ninfer.models.batch.ForwardBatch`;
who owns which page or slot is the runtime's business, not the model's.
"""
from __future__ import annotations

import torch

from ninfer.config import ModelConfig
from ninfer.kernels.attention import PagedKV


class ModelCache:
    """KV pages for every full-attention layer and conv/recurrent state slots for every DeltaNet layer.

    ``kv[i]``: :class:`PagedKV` pages ``[num_pages, page_size, kv_heads, head_dim]`` in ``kv_dtype``
    (``"auto"`` = the model dtype, ``"bf16"``, ``"fp8"``, ``"int8"``; see :mod:`ninfer.kernels.attention`);
    ``conv[i]``: ``[num_slots, conv_dim, kernel - 1]`` (the last pre-conv inputs) in the model dtype;
    ``recurrent[i]``: ``[num_slots, Hv, dk, dv]`` in fp32.

    ``with_mtp`` adds the MTP layer's K/V as ``kv[num_hidden_layers]`` (the index the layer would
    have after the decoder's): its entry for position ``t`` lives in the same page slot as the
    target's token ``t``, so page copies, host offload and prefix sharing carry it along.

    Host copies of slots and pages (prefix-cache offload, pause snapshots) are the runtime's:
    :class:`ninfer.runtime.host_cache.HostCache` reads and writes :meth:`state_tensors` and :meth:`page_tensors`.
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
        for state in self.state_tensors():
            state[dst].copy_(state[src])

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one state slot (every DeltaNet layer): what a host copy of a slot moves."""
        return sum(s[0].numel() * s.element_size() for s in self.state_tensors())

    @property
    def page_nbytes(self) -> int:
        """Bytes of one KV page (every attention layer, scales included): what a host copy moves per page."""
        return sum(t[0].numel() * t.element_size() for t in self.page_tensors())

    def state_tensors(self) -> list[torch.Tensor]:
        """Every DeltaNet layer's conv then recurrent state, ``[num_slots, ...]`` each."""
        return [*self.conv.values(), *self.recurrent.values()]

    def page_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's k, v (and scales, when quantized), ``[num_pages, ...]`` each."""
        return [t for kv in self.kv.values() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]

    @property
    def device(self) -> torch.device:
        return next(iter((*self.conv.values(), *(kv.k for kv in self.kv.values())))).device

    def reset_slot(self, slot: int) -> None:
        """Zero a state slot so a new sequence starts from the empty state."""
        for state in self.state_tensors():
            state[slot].zero_()

