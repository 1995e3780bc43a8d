"""Causal depthwise conv1d + SiLU over a ragged batch, with per-sequence state slots.

A state slot holds the last ``K - 1`` pre-conv inputs of its sequence (oldest first), so a chunk
continues exactly where the previous one stopped; decode is the ``T = 1`` case of the same op.

Triton design: program ``(b, tile, channel block)`` owns ``BLOCK_T`` consecutive tokens of sequence
``b`` for ``BLOCK_C`` channels and walks them in an unrolled loop, keeping the previous ``K - 1``
inputs in registers, so every input is read from memory once (plus a ``K - 1``-row halo per tile);
all of a tile's loads are issued before its first store so their latencies overlap.
Only tile 0 of a sequence touches its state slot: it reads the old state as its halo and, after a
block barrier, writes the new one. Because ``BLOCK_T >= K - 1``, no other tile's halo reaches
before the sequence start, so no program can read a slot another program is rewriting. Decode
(``max_seqlen == 1``) is the ``BLOCK_T = 1`` specialisation of the same kernel.

Speculative verification (``state_out_slots``) needs the window after *every* token: then one
tile covers the whole sequence (at most ``BLOCK_T`` tokens), the input slot is only read, and the
register history after token ``t`` is stored to slot ``state_out_slots[b, t]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton

PER_TOKEN_MAX_SEQLEN = 8  # verification steps: 1 + at most 7 draft tokens


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(conv(x))`` for ``x [N, C]`` packed by ``cu_seqlens [B + 1]``; weight ``[C, K]``.

    ``conv_state [S, C, K - 1]`` is read at ``slot_ids [B]`` as the inputs before each sequence's
    first token and overwritten with the inputs after its last one. ``max_seqlen`` (host int,
    optional) lets kernels choose the decode path without a device sync. With ``state_out_slots [B, max_T]``
    the window after token ``t`` goes to slot ``state_out_slots[b, t]`` and the input slot is only
    read (per-token windows for speculative verification). The conv runs in the weight's dtype as
    transformers' ``conv1d`` does (fp32 accumulation, the sum rounded to the weight dtype), then the SiLU.
    """
    taps = weight.shape[1]
    acc = torch.promote_types(weight.dtype, torch.float32)
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        window = torch.cat([conv_state[slot].to(weight.dtype), x[start:end].t().to(weight.dtype)], dim=-1)
        # The depthwise conv as a sum over the taps (torch's grouped conv1d is slow on small CPU inputs), with
        # conv1d's numerics: products and sum in at least fp32, one rounding to the weight dtype (a bf16 product
        # would round every tap).
        y = (window.unfold(-1, taps, 1).to(acc) * weight.to(acc)[:, None, :]).sum(-1).to(weight.dtype)  # [C, T]
        out[start:end] = F.silu(y).t().to(x.dtype)
        if state_out_slots is not None:
            for t in range(end - start):  # the window after token t ends at window column t + taps - 1
                conv_state[int(state_out_slots[b, t])] = window[:, t + 1:t + taps].to(conv_state.dtype)
        else:
            conv_state[slot] = window[:, -(taps - 1):].to(conv_state.dtype)
    return out


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, state_ptr, cu_ptr, slot_ptr, out_ptr, out_slot_ptr,
    C, sx_n, sw_c, sw_k, ss_s, ss_c, ss_k, so_b,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PER_TOKEN: tl.constexpr,
):
    seq, tile, cblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    t0 = tile.to(tl.int64) * BLOCK_T  # int64: position * row stride passes 2**31 on long prefills
    if t0 < length:  # the grid is sized for max_seqlen; shorter sequences leave programs idle
        wdt = w_ptr.dtype.element_ty  # the reference convolves in the weight dtype
        chans = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = chans < C
        slot_row = state_ptr + tl.load(slot_ptr + seq).to(tl.int64) * ss_s + chans * ss_c
        x_rows = x_ptr + start * sx_n + chans  # + position * sx_n
        # hist[i] = input at sequence position t0 - (K - 1) + i: the old state before position 0.
        hist = ()
        for i in tl.static_range(K - 1):
            pos = t0 - (K - 1) + i
            from_x = tl.load(x_rows + pos * sx_n, mask=cmask & (pos >= 0), other=0.0)
            from_state = tl.load(slot_row + (K - 1 + pos) * ss_k, mask=cmask & (pos < 0), other=0.0)
            hist = hist + (tl.where(pos < 0, from_state.to(wdt), from_x.to(wdt)).to(tl.float32),)
        # New state = the last K - 1 window inputs (for length < K - 1 partly old state). Only tile
        # 0 writes it; its values are loaded here, with the other loads, and stored at the end.
        new = ()
        for j in tl.static_range(K - 1):
            pos = length - (K - 1) + j
            from_x = tl.load(x_rows + pos * sx_n, mask=cmask & (tile == 0) & (pos >= 0), other=0.0)
            from_state = tl.load(slot_row + (K - 1 + pos) * ss_k, mask=cmask & (tile == 0) & (pos < 0), other=0.0)
            new = new + (tl.where(pos < 0, from_state.to(wdt), from_x.to(wdt)),)
        w = ()
        for k in tl.static_range(K):
            w = w + (tl.load(w_ptr + chans * sw_c + k * sw_k, mask=cmask, other=0.0).to(tl.float32),)
        # Issue every load of the tile before the first store: the compiler may not move a load
        # across a store (out could alias x), so interleaving them would serialise the latencies.
        tile_x = ()
        for i in tl.static_range(BLOCK_T):
            tile_x = tile_x + (tl.load(x_rows + (t0 + i) * sx_n, mask=cmask & (t0 + i < length), other=0.0),)
        for i in tl.static_range(BLOCK_T):
            cur = tile_x[i].to(wdt).to(tl.float32)
            acc = cur * w[K - 1]
            for k in tl.static_range(K - 1):
                acc += hist[k] * w[k]
            y = acc.to(wdt).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(wdt)
            tl.store(out_ptr + (start + t0 + i) * C + chans, y.to(out_ptr.dtype.element_ty),
                     mask=cmask & (t0 + i < length))
            hist = hist[1:] + (cur,)
            if PER_TOKEN:  # the window after token i goes to its own slot
                out_row = state_ptr + tl.load(out_slot_ptr + seq * so_b + i).to(tl.int64) * ss_s + chans * ss_c
                for j in tl.static_range(K - 1):
                    tl.store(out_row + j * ss_k, hist[j].to(state_ptr.dtype.element_ty), mask=cmask & (i < length))
        if tile == 0 and not PER_TOKEN:
            tl.debug_barrier()  # every read of the old slot in this block happens before any write
            for j in tl.static_range(K - 1):
                tl.store(slot_row + j * ss_k, new[j].to(state_ptr.dtype.element_ty), mask=cmask)


CONV_SHORT_TILE = 4  # tokens of the tile for calls of 2 to this many tokens per sequence (prefill tiles 8)


def _conv_config(max_seqlen: int, taps: int, channels: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_C, num_warps)``.

    256 channels on two warps (4 per thread: 8-byte bf16 loads, 512 contiguous bytes per row).
    Prefill tiles 8 tokens: at ~72 registers about 14 programs (28 warps) stay resident per SM,
    which keeps more loads in flight than fewer, longer tiles do (H200, 8192 x 10240 bf16: 8-token
    tiles reach 71% of copy bandwidth, 16: 66%, 32: 57% at ~170 registers); the ``K - 1``-row halo
    each tile re-reads is an L2 hit. Decode unrolls one step; calls of at most 4 tokens use 4.
    """
    block_c = min(256, triton.next_power_of_2(channels))
    num_warps = max(1, min(2, block_c // 128))
    if max_seqlen <= 1:
        return 1, block_c, num_warps
    block_t = CONV_SHORT_TILE if max_seqlen <= CONV_SHORT_TILE else 8
    return max(block_t, triton.next_power_of_2(taps - 1)), block_c, num_warps


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`causal_conv1d_reference`; updates ``conv_state`` in place, no host sync.

    ``max_seqlen`` must bound every sequence's length (``None`` means ``x.shape[0]``); ``1`` selects
    the decode specialisation. With ``state_out_slots [B, >= max_seqlen]`` (at most
    ``PER_TOKEN_MAX_SEQLEN`` tokens per sequence) every token's window goes to its own slot.
    """
    n, channels = x.shape
    taps = weight.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    batch = slot_ids.shape[0]
    if n == 0 or batch == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    bound = n if max_seqlen is None else max_seqlen
    block_t, block_c, num_warps = _conv_config(bound, taps, channels)
    per_token = state_out_slots is not None
    if per_token:  # one tile must see the whole sequence to emit every window
        if bound > PER_TOKEN_MAX_SEQLEN:
            raise ValueError(f"per-token conv states need max_seqlen <= {PER_TOKEN_MAX_SEQLEN}, got {bound}")
        block_t = max(block_t, triton.next_power_of_2(bound))
    out_slots = state_out_slots if per_token else slot_ids
    grid = (batch, triton.cdiv(bound, block_t), triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, conv_state, cu_seqlens, slot_ids, out, out_slots,
        channels, x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out_slots.stride(0),
        K=taps, BLOCK_T=block_t, BLOCK_C=block_c, PER_TOKEN=per_token, num_warps=num_warps,
    )
    return out


def save_conv_windows(x: torch.Tensor, conv_state: torch.Tensor,
                      checkpoints: tuple[tuple[int, int, int, int], ...]) -> None:
    """For each ``(row, r, own_slot, slot)``: the conv window after the first ``r`` tokens of the sequence
    whose tokens start at row ``row`` of ``x [N, C]`` (its last ``K - 1`` inputs, the older ones from its
    state slot ``own_slot``) goes to ``conv_state[slot]``. Call before :func:`causal_conv1d` overwrites
    ``own_slot``. Host ints: no device sync, a few small copies per checkpoint."""
    keep = conv_state.shape[-1]
    for row, r, own_slot, slot in checkpoints:
        new = x[row + max(r - keep, 0):row + r].t().to(conv_state.dtype)
        old = conv_state[own_slot, :, r:] if r < keep else new[:, :0]
        conv_state[slot] = torch.cat([old, new], dim=-1)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(x):
        return causal_conv1d_triton(x, weight, conv_state, cu_seqlens, slot_ids, max_seqlen, state_out_slots)
    return causal_conv1d_reference(x, weight, conv_state, cu_seqlens, slot_ids, max_seqlen, state_out_slots)
