"""Causal GQA attention over a paged KV cache.

K/V live in pages ``[num_pages, page_size, kv_heads, head_dim]``; each sequence owns the pages
listed in its row of ``block_tables``. A call appends the batch's new K/V at ``slot_mapping``
(flat token slots: ``page * page_size + offset``) and then attends: the new tokens of sequence
``b`` are the last ``seqlen_b`` of its ``context_lens[b]`` tokens, each seeing itself and
everything before it. Query head ``h`` reads KV head ``h // (q_heads / kv_heads)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """One attention layer's paged K/V storage: ``[num_pages, page_size, kv_heads, head_dim]`` each."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str) -> "PagedKV":
        shape = (num_pages, page_size, num_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [N, kv_heads, head_dim]`` into the pages at flat token slots ``slot_mapping [N]``."""
    pages, offsets = slot_mapping // kv.page_size, slot_mapping % kv.page_size
    kv.k[pages, offsets] = k.to(kv.k.dtype)
    kv.v[pages, offsets] = v.to(kv.v.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """``q [N, q_heads, head_dim]`` packed by ``cu_seqlens [B + 1]`` -> ``o [N, q_heads, head_dim]``.

    Softmax in fp32, probabilities cast back to the query dtype before the product with V (the
    transformers eager path). ``max_seqlen`` (host int, optional): the longest new-token count,
    so kernels can pick the decode path without a device sync.
    """
    page_size = kv.page_size
    group = q.shape[1] // kv.k.shape[2]
    out = torch.empty_like(q)
    bounds, lens = cu_seqlens.tolist(), context_lens.tolist()
    for b in range(len(lens)):
        start, end, ctx = bounds[b], bounds[b + 1], lens[b]
        if end == start:
            continue
        pages = block_tables[b, : (ctx + page_size - 1) // page_size]
        keys = kv.k[pages].flatten(0, 1)[:ctx].to(q.dtype).repeat_interleave(group, 1)  # [ctx, H, D]
        values = kv.v[pages].flatten(0, 1)[:ctx].to(q.dtype).repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q[start:end], keys) * scale
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.einsum("hts,shd->thd", probs, values)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    write_kv_reference(k, v, kv, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    return paged_attention_reference(q, kv, block_tables, cu_seqlens, context_lens, scale, max_seqlen)
