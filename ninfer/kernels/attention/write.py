"""Appending K/V to the paged cache, quantising to fp8/int8 on the way.

One program stores one token: all its KV heads of K and of V, ``[heads, n_groups, group]`` at a
time, so each group's scale is a reduction inside the tile. The arithmetic repeats
``quantize_kv_reference`` op for op (same divisions, same rounding), so codes match it exactly.
The fp8 code is built with integer ops rather than a float8 cast: the Triton CPU interpreter
mis-rounds fp32 -> e4m3 when rounding carries into the exponent, and the integer form is exact
round-to-nearest-even on every backend.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.common import QUANT_CODE
from ninfer.kernels.attention.paged import PagedKV

FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)
TINY_AMAX = tl.constexpr(1e-30)


@triton.jit
def fp32_to_e4m3_bits(y):
    """e4m3fn bit pattern of ``y`` (already within +-448), rounded to nearest even, as uint8."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # Normal range (|y| >= 2^-6, fp32 exponent >= 121): round the mantissa to 3 bits; a carry
    # correctly bumps the exponent. Then rebias the exponent from 127 to 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals: the value in units of 2^-9, rounded to nearest even (8 encodes 2^-6 exactly).
    mant = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exp, 31)
    sub = (mant + ((1 << (shift - 1)) - 1) + ((mant >> shift) & 1)) >> shift
    return (tl.where(exp >= 121, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _store_token(src_ptr, stride_h, dst_ptr, scale_ptr, stride_dh, stride_sh, heads,
                 HEADS_P2: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, QUANT: tl.constexpr):
    """Store one token's ``[heads, NG * GS]`` rows at ``dst_ptr`` (and their scales at ``scale_ptr``)."""
    offs_h = tl.arange(0, HEADS_P2)[:, None, None]
    col = tl.arange(0, NG)[None, :, None] * GS + tl.arange(0, GS)[None, None, :]
    mask = offs_h < heads
    raw = tl.load(src_ptr + offs_h * stride_h + col, mask=mask, other=0)
    dst = dst_ptr + offs_h * stride_dh + col
    if QUANT == 0:
        tl.store(dst, raw.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        x = raw.to(tl.float32)
        qmax = FP8_MAX if QUANT == 1 else INT8_MAX
        amax = tl.max(tl.abs(x), 2)
        nonzero = amax > TINY_AMAX
        qmax_t = tl.full(amax.shape, qmax, tl.float32)
        inv = tl.where(nonzero, tl.math.div_rn(qmax_t, tl.where(nonzero, amax, 1.0)), 0.0)
        y = x * inv[:, :, None]
        if QUANT == 1:
            code = fp32_to_e4m3_bits(tl.minimum(tl.maximum(y, -qmax), qmax))
        else:
            code = tl.minimum(tl.maximum(tl.floor(y + 0.5), -qmax), qmax).to(tl.int8)
        tl.store(dst, code, mask=mask)
        scale_offs = tl.arange(0, HEADS_P2)[:, None] * stride_sh + tl.arange(0, NG)[None, :]
        tl.store(scale_ptr + scale_offs, tl.math.div_rn(amax, qmax_t),
                 mask=tl.arange(0, HEADS_P2)[:, None] < heads)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_pp, stride_ps, stride_ph, stride_sp, stride_ss, stride_sh,
    heads, PAGE_SIZE: tl.constexpr, HEADS_P2: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr,
    QUANT: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    row = page * stride_pp + offset * stride_ps
    srow = page * stride_sp + offset * stride_ss
    n = n.to(tl.int64)
    _store_token(k_ptr + n * stride_kn, stride_kh, kp_ptr + row, ks_ptr + srow, stride_ph, stride_sh, heads,
                 HEADS_P2, NG, GS, QUANT)
    _store_token(v_ptr + n * stride_vn, stride_vh, vp_ptr + row, vs_ptr + srow, stride_ph, stride_sh, heads,
                 HEADS_P2, NG, GS, QUANT)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv: "PagedKV", slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [N, kv_heads, head_dim]`` at flat slots ``slot_mapping [N]``, quantising if the cache does."""
    n, heads, head_dim = k.shape
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert kv.k.is_contiguous() and kv.v.is_contiguous() and head_dim == triton.next_power_of_2(head_dim)
    if n == 0:
        return
    quant = QUANT_CODE[kv.quant]
    kp, vp = (kv.k.view(torch.uint8), kv.v.view(torch.uint8)) if quant == 1 else (kv.k, kv.v)
    ks, vs = (kv.k_scale, kv.v_scale) if quant else (kv.k, kv.v)  # placeholders, never read when QUANT == 0
    ng = ks.shape[-1] if quant else 1
    _write_kv_kernel[(n,)](
        k_ptr=k, v_ptr=v, slot_ptr=slot_mapping, kp_ptr=kp, vp_ptr=vp, ks_ptr=ks, vs_ptr=vs, stride_kn=k.stride(0),
        stride_kh=k.stride(1), stride_vn=v.stride(0), stride_vh=v.stride(1), stride_pp=kv.k.stride(0),
        stride_ps=kv.k.stride(1), stride_ph=kv.k.stride(2), stride_sp=ks.stride(0), stride_ss=ks.stride(1),
        stride_sh=ks.stride(2), heads=heads, PAGE_SIZE=kv.page_size, HEADS_P2=triton.next_power_of_2(heads), NG=ng,
        GS=head_dim // ng, QUANT=quant, num_warps=4,
    )
