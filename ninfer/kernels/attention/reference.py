"""Plain-PyTorch references of the paged K/V write and of causal paged attention; they define correctness
and are the CPU path. Quantised formats are quantised on write and dequantised on read exactly as the
Triton kernels do, so both paths see the same cache contents."""
from __future__ import annotations

import torch

from ninfer.kernels.attention.paged import QUANT_MAX, TINY_AMAX, PagedKV


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
