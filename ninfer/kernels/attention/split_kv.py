"""Split-KV pieces shared by the decode and the prefill kernels: the key range of a split, the merge of
the splits' partial outputs (lse-weighted, applying the gate) and the SM count that sizes the splits."""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.common import store_output
from ninfer.kernels.pdl import pdl_enter


SPLIT_ALIGN = tl.constexpr(64)
MAX_SPLITS = 64


@triton.jit
def split_range(ctx, split, num_splits):
    """Keys ``[lo, hi)`` of ``split``; identical in both kernels, so the merge knows which splits ran."""
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    lo = split * chunk
    return lo, tl.minimum(lo + chunk, ctx), tl.cdiv(ctx, chunk)


@triton.jit
def merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr, g_ptr, cu_ptr, ctx_ptr,
    stride_on, stride_oh, stride_gn, stride_gh, num_splits,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_POW2: tl.constexpr, HAS_GATE: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False,
):
    """One output row (token, head): the lse-weighted mean of its splits' partial outputs. ``PDL_TRIGGER``: the
    output projection after it may launch now and request its weights (programmatic dependent launch)."""
    pdl_enter(False, PDL_TRIGGER)
    head = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    if t >= tl.load(cu_ptr + b + 1) - start:
        return
    _, _, n_splits = split_range(tl.load(ctx_ptr + b), 0, num_splits)
    offs_s = tl.arange(0, SPLITS_POW2)
    ran = offs_s < n_splits
    offs_d = tl.arange(0, HEAD_DIM)
    tok = (start + t).to(tl.int64)
    part = (tok * HEADS + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=ran, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ran[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    one = tl.full([1], 0, tl.int64)
    store_output(o_ptr, g_ptr, o[None, :], tok + one, head + one, offs_d, one == 0, stride_on, stride_oh,
                 stride_gn, stride_gh, HAS_GATE)


@lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
