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
read, here and in the Triton kernels alike (``attention_write``, ``attention_prefill``,
``attention_decode``), so both paths see the same cache contents.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.attention_decode import DECODE_MAX_TOKENS, paged_attention_decode_triton
from ninfer.kernels.attention_prefill import paged_attention_prefill_triton
from ninfer.kernels.attention_write import write_kv_triton
from ninfer.kernels.dispatch import use_triton

KV_DTYPES = ("auto", "bf16", "fp8", "int8")
QUANT_MAX = {"fp8": 448.0, "int8": 127.0}  # largest code magnitude of each quantised format
INT8_GROUP = 64  # values sharing one int8 scale
# Rows whose largest magnitude is below this quantise to zero: their reciprocal scale would overflow.
TINY_AMAX = 1e-30


@dataclass
class PagedKV:
    """One attention layer's paged K/V storage: ``[num_pages, page_size, kv_heads, head_dim]`` each.

    ``k_scale``/``v_scale`` ``[num_pages, page_size, kv_heads, n_groups]`` (fp32) exist only for the
    quantised formats; ``value = code * scale`` over consecutive groups of ``head_dim / n_groups``.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, kv_dtype: str = "auto") -> "PagedKV":
        """``dtype`` is the model dtype ("auto" stores in it); ``kv_dtype`` one of :data:`KV_DTYPES`."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        shape = (num_pages, page_size, num_heads, head_dim)
        storage = {"auto": dtype, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_dtype]
        k, v = torch.zeros(shape, dtype=storage, device=device), torch.zeros(shape, dtype=storage, device=device)
        if kv_dtype not in QUANT_MAX:
            return cls(k, v)
        group = head_dim if kv_dtype == "fp8" else min(INT8_GROUP, head_dim)
        if head_dim % group:
            raise ValueError(f"int8 KV needs head_dim divisible by {group}, got {head_dim}")
        scale_shape = (num_pages, page_size, num_heads, head_dim // group)
        return cls(k, v, torch.zeros(scale_shape, dtype=torch.float32, device=device),
                   torch.zeros(scale_shape, dtype=torch.float32, device=device))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def quant(self) -> str | None:
        """``"fp8"``, ``"int8"``, or ``None`` when values are stored as they are."""
        return {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}.get(self.k.dtype)


def quantize_kv_reference(x: torch.Tensor, quant: str, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(codes [..., D], scales [..., n_groups])`` with ``x ~ code * scale``.

    ``scale = amax / qmax`` per group; codes are ``x * (qmax / amax)`` rounded (to nearest even for
    fp8, half up for int8), so the largest magnitude of a group maps to ``qmax``.
    """
    qmax = QUANT_MAX[quant]
    xg = x.float().unflatten(-1, (n_groups, -1))
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > TINY_AMAX, amax.new_tensor(qmax) / amax, 0.0)
    y = xg * inv[..., None]
    if quant == "fp8":
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    else:
        codes = torch.floor(y + 0.5).clamp(-qmax, qmax).to(torch.int8)
    return codes.flatten(-2), amax / qmax


def dequantize_kv_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_reference`, in fp32."""
    groups = codes.float().unflatten(-1, (scales.shape[-1], -1))
    return (groups * scales[..., None]).flatten(-2)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [N, kv_heads, head_dim]`` into the pages at flat token slots ``slot_mapping [N]``."""
    pages, offsets = slot_mapping // kv.page_size, slot_mapping % kv.page_size
    if kv.quant is None:
        kv.k[pages, offsets] = k.to(kv.k.dtype)
        kv.v[pages, offsets] = v.to(kv.v.dtype)
        return
    for x, codes, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
        new_codes, scales[pages, offsets] = quantize_kv_reference(x, kv.quant, scales.shape[-1])
        # Indexing through byte views: not every device implements index_put for float8.
        codes.view(torch.uint8)[pages, offsets] = new_codes.view(torch.uint8)


def _read_pages(codes: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor, ctx: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The first ``ctx`` tokens stored in ``pages``, dequantised and cast to ``dtype``: ``[ctx, kv_heads, D]``."""
    if scales is None:
        return codes[pages].flatten(0, 1)[:ctx].to(dtype)
    rows = codes.view(torch.uint8)[pages].flatten(0, 1)[:ctx].view(codes.dtype)
    return dequantize_kv_reference(rows, scales[pages].flatten(0, 1)[:ctx]).to(dtype)


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
        keys = _read_pages(kv.k, kv.k_scale, pages, ctx, q.dtype).repeat_interleave(group, 1)  # [ctx, H, D]
        values = _read_pages(kv.v, kv.v_scale, pages, ctx, q.dtype).repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q[start:end], keys) * scale
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.einsum("hts,shd->thd", probs, values)
    return out


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
