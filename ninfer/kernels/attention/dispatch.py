"""Causal GQA attention over a paged KV cache.

K/V live in pages ``[num_pages, page_size, kv_heads, head_dim]``; each sequence owns the pages
listed in its row of ``block_tables``. A call appends the batch's new K/V at ``slot_mapping``
(flat token slots: ``page * page_size + offset``) and then attends: the new tokens of sequence
``b`` are the last ``seqlen_b`` of its ``context_lens[b]`` tokens, each seeing itself and
everything before it. Query head ``h`` reads KV head ``h // (q_heads / kv_heads)``.

Storage formats (``kv_dtype``): ``"auto"`` (the model dtype), ``"bf16"``, ``"fp8"`` (e4m3 with one
fp32 scale per row, a row being one token's one head) and ``"int8"`` (symmetric, one fp32 scale per
64 values). Quantised formats keep their scales in ``k_scale``/``v_scale``
``[num_pages, page_size, kv_heads, n_groups]``; values are quantised on write and dequantised on
read, here and in the Triton kernels alike (``write``, ``prefill``, ``decode``; the references in
``reference``), so both paths see the same cache contents.
"""
from __future__ import annotations

import torch

from ninfer.kernels.attention.decode import DECODE_MAX_TOKENS, paged_attention_decode_triton
from ninfer.kernels.attention.paged import PagedKV
from ninfer.kernels.attention.prefill import paged_attention_prefill_triton
from ninfer.kernels.attention.reference import paged_attention_reference, write_kv_reference
from ninfer.kernels.attention.write import write_kv_triton
from ninfer.kernels.dispatch import use_triton


def paged_attention_triton(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
    *,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-KV decode kernel when every sequence adds at most ``DECODE_MAX_TOKENS`` tokens, else the
    tiled prefill kernel (``max_seqlen`` unknown means prefill, bounded by the token count)."""
    args = (q, kv, block_tables, cu_seqlens, context_lens, scale)
    if max_seqlen is not None and max_seqlen <= DECODE_MAX_TOKENS:
        return paged_attention_decode_triton(*args, max_seqlen, gate=gate, out=out)
    return paged_attention_prefill_triton(*args, max_seqlen or q.shape[0], gate=gate, out=out)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    if use_triton(k):
        write_kv_triton(k, v, kv, slot_mapping)
    else:
        write_kv_reference(k, v, kv, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
    *,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output, times ``sigmoid(gate [N, q_heads, head_dim])`` (in q's dtype) when a gate is given."""
    if use_triton(q):
        return paged_attention_triton(q, kv, block_tables, cu_seqlens, context_lens, scale, max_seqlen, gate=gate)
    out = paged_attention_reference(q, kv, block_tables, cu_seqlens, context_lens, scale, max_seqlen)
    return out if gate is None else out * torch.sigmoid(gate)
