"""Pieces shared by the paged-attention kernels: reading a K/V tile through the page table
(dequantising on the fly), one online-softmax step, the gated epilogue, and launcher checks.

Key ``j`` of a sequence lives in page ``block_tables[b, j // PAGE_SIZE]`` at offset
``j % PAGE_SIZE``; the page is looked up per key row, so a tile may straddle pages and any page
size works with any tile size. ``QUANT``: 0 = stored as is, 1 = fp8 e4m3 (read through a uint8
view), 2 = int8; scales come in ``NG`` groups per row.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.paged import PagedKV

QUANT_CODE = {None: 0, "fp8": 1, "int8": 2}
LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * LOG2E)


@triton.jit
def kv_tile_rows(bt_row, offs_n, valid_n, kvh, stride_p, stride_s, stride_h, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of keys ``offs_n`` of one KV head; invalid keys read page 0, in bounds."""
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=valid_n, other=0).to(tl.int64)
    return page * stride_p + (offs_n % PAGE_SIZE).to(tl.int64) * stride_s + kvh * stride_h, page


@triton.jit
def load_kv_tile(data_ptr, scale_ptr, rows, page, offs_n, offs_d, valid_n, kvh,
                 stride_sp, stride_ss, stride_sh, dtype: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 QUANT: tl.constexpr, NG: tl.constexpr, MASKED: tl.constexpr):
    """``[BLOCK_N, HEAD_DIM]`` values in ``dtype``; masked rows are zero (so ``0 * V`` stays finite)."""
    ptrs = data_ptr + rows[:, None] + offs_d[None, :]
    if MASKED:
        raw = tl.load(ptrs, mask=valid_n[:, None], other=0)
    else:
        raw = tl.load(ptrs)
    if QUANT == 0:
        return raw.to(dtype)
    if QUANT == 1:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = raw.to(tl.float32)
    srow = page * stride_sp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_ss + kvh * stride_sh
    if NG == 1:
        x = x * tl.load(scale_ptr + srow, mask=valid_n, other=0)[:, None]
    else:
        s = tl.load(scale_ptr + srow[:, None] + tl.arange(0, NG)[None, :], mask=valid_n[:, None], other=0)
        grouped = tl.reshape(x, (x.shape[0], NG, x.shape[1] // NG)) * s[:, :, None]
        x = tl.reshape(grouped, (x.shape[0], x.shape[1]))
    return x.to(dtype)


@triton.jit
def softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, DOT_PREC: tl.constexpr):
    """One online-softmax update with keys ``k``/values ``v [BLOCK_N, D]``; scores in log2 units.

    A row that has seen no visible key yet keeps ``m = -inf``; using 0 as its reference max keeps
    ``exp2`` away from ``-inf - -inf`` so such rows contribute nothing instead of NaN.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def store_output(o_ptr, g_ptr, o, tok, head, offs_d, mask, stride_on, stride_oh, stride_gn, stride_gh,
                 HAS_GATE: tl.constexpr):
    """Store ``o`` rounded to the output dtype, times ``sigmoid(gate)`` rounded likewise (the
    model's ``o * torch.sigmoid(gate)`` in its dtype)."""
    dtype = o_ptr.dtype.element_ty
    o = o.to(dtype)
    if HAS_GATE:
        g = tl.load(g_ptr + tok[:, None] * stride_gn + head[:, None] * stride_gh + offs_d[None, :],
                    mask=mask[:, None], other=0).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(dtype)
        o = (o.to(tl.float32) * sig.to(tl.float32)).to(dtype)
    tl.store(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :], o, mask=mask[:, None])


def kernel_args(q: torch.Tensor, kv: "PagedKV", block_tables: torch.Tensor, gate: torch.Tensor | None,
                out: torch.Tensor | None) -> tuple[torch.Tensor, list[Any], dict[str, Any]]:
    """Checks layouts and returns ``(out, tensor/stride args, constexprs)`` common to both kernels."""
    n, heads, head_dim = q.shape
    kv_heads = kv.k.shape[2]
    assert heads % kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim), (heads, kv_heads, head_dim)
    assert q.stride(-1) == 1 and kv.k.is_contiguous() and kv.v.is_contiguous() and kv.k.stride() == kv.v.stride()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if gate is not None:
        assert gate.shape == q.shape and gate.stride(-1) == 1, "gate must be [N, q_heads, head_dim], unit last stride"
    quant = QUANT_CODE[kv.quant]
    k, v = (kv.k.view(torch.uint8), kv.v.view(torch.uint8)) if quant == 1 else (kv.k, kv.v)
    ks, vs = (kv.k_scale, kv.v_scale) if quant else (kv.k, kv.v)  # placeholders, never read when QUANT == 0
    assert ks.is_contiguous() and vs.is_contiguous() and ks.stride() == vs.stride()
    g = out if gate is None else gate
    args = [q, k, v, ks, vs, block_tables, out, g,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), g.stride(0), g.stride(1),
            kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0)]
    consts = dict(GROUP=heads // kv_heads, PAGE_SIZE=kv.page_size, HEAD_DIM=head_dim, QUANT=quant,
                  NG=ks.shape[-1] if quant else 1, HAS_GATE=gate is not None,
                  DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
    return out, args, consts
