"""The register-only kernel variants of ``perf/probe_gemv_layout.py`` (diagnostics, not shipped): weights go
from global memory straight into registers, with no shared memory on the weight path. Two of them: an int4 x int8
``dp4a`` GEMV, and the register-fragment decode, whose weights are laid out so that each lane loads its own
``mma.sync`` operands. The ``dp4a`` kernel runs in the interpreter; the fragment kernel is PTX throughout (GPU
only; its layouts are checked on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import gemv_epilogue
from ninfer.kernels.quant_gemm.tune import GemmConfig
from probe_gemv_kernels import GROUP


_DP4A = tl.constexpr("dp4a.u32.s32 $0, $1, $2, $3;")


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """``c + sum_i a.u8[i] * b.s8[i]`` per 32-bit lane (the interpreter: the same from bit operations)."""
    if ASM:
        out = tl.inline_asm_elementwise(_DP4A, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c
        for i in tl.static_range(4):
            ai = (a >> (8 * i)) & 0xFF
            bi = ((b << (24 - 8 * i)) >> 24)  # arithmetic shift: sign-extended byte i
            out = out + ai * bi
    return out


@triton.jit(do_not_specialize=["k_per_split"])
def _w4a8_kernel(q_ptr, s_ptr, xe_ptr, xo_ptr, xs_ptr, xsum_ptr, out_ptr, ws_ptr, cnt_ptr, N_OUT, KW, k_per_split,
                 stride_sn, M, MT: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KW: tl.constexpr, ASM: tl.constexpr):
    """int4 weights x int8 activations (per 128-column group scales), ``dp4a`` on 32-bit words: word ``w`` of a
    row holds columns ``8w .. 8w+7``; its low nibbles (even columns) meet ``xe`` (x's even columns as packed
    int8), its high nibbles ``xo``. Weights stream into registers (no shared memory); M tokens per program."""
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n
    GW: tl.constexpr = 16  # words per 128-column group
    acc = tl.zeros((BLOCK_N, MT), dtype=tl.float32)
    cols_m = tl.arange(0, MT)
    kw_first = pid_s * k_per_split
    for kw in range(kw_first, kw_first + k_per_split, BLOCK_KW):
        w = tl.load(q_ptr + rows.to(tl.int64)[:, None] * KW + (kw + tl.arange(0, BLOCK_KW))[None, :])
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        g0 = kw // GW
        wscale = tl.load(s_ptr + rows[:, None] * stride_sn + (g0 + tl.arange(0, BLOCK_KW // GW))[None, :]).to(tl.float32)
        for m in tl.static_range(MT):
            xe = tl.load(xe_ptr + m * KW + kw + tl.arange(0, BLOCK_KW))
            xo = tl.load(xo_ptr + m * KW + kw + tl.arange(0, BLOCK_KW))
            d = _dp4a(hi, xo[None, :], _dp4a(lo, xe[None, :], tl.zeros_like(lo), ASM), ASM)
            gsum = tl.sum(tl.reshape(d, (BLOCK_N, BLOCK_KW // GW, GW)), axis=2)  # [BLOCK_N, groups] int32
            xsum = tl.load(xsum_ptr + m * (KW // GW) + g0 + tl.arange(0, BLOCK_KW // GW))
            xs = tl.load(xs_ptr + m * (KW // GW) + g0 + tl.arange(0, BLOCK_KW // GW))
            y = tl.sum((gsum - 8 * xsum[None, :]).to(tl.float32) * wscale * xs[None, :], axis=1)
            acc += tl.where(cols_m[None, :] == m, y[:, None], 0.0)
    offs_m = cols_m
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, out_ptr, N_OUT, out_ptr,
                  N_OUT, SPLIT, FUSED_REDUCE, False, False, BLOCK_N, MT)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x ``[M, K]`` -> int8 per 128-column group: (even-column words, odd-column words ``[M, K/8]`` int32, scales
    ``[M, K/128]`` fp32, group sums of the int8 values ``[M, K/128]`` int32)."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    xs = g.abs().amax(-1).clamp_min(1e-20) / 127
    xq = torch.round(g / xs[..., None]).clamp(-127, 127).to(torch.int8).view(m, k)
    xsum = xq.view(m, k // GROUP, GROUP).sum(-1, dtype=torch.int32)
    xe = xq[:, 0::2].contiguous().view(torch.int32)  # columns 8w + 0, 2, 4, 6 -> word w
    xo = xq[:, 1::2].contiguous().view(torch.int32)
    return xe, xo, xs.contiguous(), xsum.contiguous()


def w4a8_reference(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What :func:`launch_w4a8` computes, in fp64 from the same int8 activations."""
    m, k = x.shape
    g = x.double().view(m, k // GROUP, GROUP)
    xs = (g.abs().amax(-1).clamp_min(1e-20) / 127).float().double()
    xq = torch.round(g / xs[..., None]).clamp(-127, 127)
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).view(q.shape[0], k).double() - 8
    w = codes.view(-1, k // GROUP, GROUP) * scales.double()[..., None]
    return torch.einsum("ngc,mgc->mn", w, xq * xs[..., None])


def launch_w4a8(xq: tuple[torch.Tensor, ...], q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                cfg: GemmConfig) -> None:
    xe, xo, xs, xsum = xq
    m = xe.shape[0]
    n_out = out.shape[1]
    kw = xe.shape[1]  # weight words per row = x words per parity
    block_kw = cfg.block_k // 8
    steps = kw // block_kw
    per_split = triton.cdiv(steps, cfg.split_k)
    splits = triton.cdiv(steps, per_split)
    ws = torch.empty(splits, m, n_out, dtype=torch.float32, device=out.device) if splits > 1 else out
    grid = (triton.cdiv(n_out, cfg.block_n), splits)
    counters = tile_counters(out.device, grid[0]) if splits > 1 else None
    _w4a8_kernel[grid](q.view(torch.int32), scales, xe, xo, xs, xsum, out, ws, counters, n_out, kw,
                       per_split * block_kw, scales.stride(0), M=m, MT=m, SPLIT=splits > 1,
                       FUSED_REDUCE=counters is not None, BLOCK_N=cfg.block_n, BLOCK_KW=block_kw,
                       ASM=not INTERPRET, num_warps=cfg.num_warps)


# --- register-fragment decode: each thread loads its own mma.sync operand fragments from global memory ---
# Weights re-laid out so that the 16 bytes lane (g, t) of the warp owning a 16-row tile reads per 64 columns are
# exactly its A fragments of four m16n8k16 MMAs (no shared memory, no ldmatrix): for MMA j of chunk c, byte 0 of its
# word = W[g, 16j + 2t] | W[g, 16j + 2t + 8] << 4, byte 1 the same at column + 1, bytes 2-3 the same for row g + 8,
# so the decode's four bf16x2 outputs are A's registers in order. The activations go in lane order too
# (``frag_x``): two 16-byte loads per lane and chunk, from L1/L2 (they are shared by every row tile).
_FRAG_LOAD = tl.constexpr("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];")
_DEC = """prmt.b32 t, {w}, 0, 0x4140; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 {a0}, t, one, bias;
    prmt.b32 t, {w}, 0, 0x4342; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 {a1}, t, one, bias;
    shr.u32 h, {w}, 4;
    prmt.b32 t, h, 0, 0x4140; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 {a2}, t, one, bias;
    prmt.b32 t, h, 0, 0x4342; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 {a3}, t, one, bias;"""
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{{a}}}, {{{b}}}, "
        "{{{c}}};")


def _frag_chunk_asm() -> str:
    lines = ["{", ".reg .b32 a<16>, b<8>, t, h, one, bias;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;",
             "ld.global.v4.b32 {b0, b1, b2, b3}, [$8];", "ld.global.v4.b32 {b4, b5, b6, b7}, [$8+16];"]
    for j in range(4):
        regs = [f"a{4 * j + i}" for i in range(4)]
        lines.append(_DEC.format(w=f"${4 + j}", a0=regs[0], a1=regs[1], a2=regs[2], a3=regs[3]))
        c = "$9, $10, $11, $12" if j == 0 else "$0, $1, $2, $3"
        lines.append(_MMA.format(a=", ".join(regs), b=f"b{2 * j}, b{2 * j + 1}", c=c))
    lines.append("}")
    return "\n".join(lines)


_FRAG_CHUNK = tl.constexpr(_frag_chunk_asm())


@triton.jit
def _frag_group(d0, d1, d2, d3, w, x_addr):
    return tl.inline_asm_elementwise(_FRAG_CHUNK, "=f,=f,=f,=f,r,r,r,r,l,f,f,f,f",
                                     [w[0], w[1], w[2], w[3], x_addr, d0, d1, d2, d3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _frag_load(addr):
    return tl.inline_asm_elementwise(_FRAG_LOAD, "=r,=r,=r,=r,l", [addr],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit(do_not_specialize=["chunks_per_split"])
def _frag_kernel(q_ptr, xf_ptr, s_ptr, out_ptr, M, N, KC, chunks_per_split, stride_sn, W: tl.constexpr):
    """``out[M, N] += x @ W^T`` (fp32, atomics across splits) for M <= 8; one 16-row tile per warp, K in
    64-column chunks, two chunks per 128-column scale group."""
    e = tl.arange(0, 32 * W)  # one element per thread: element i is thread i
    lane = e % 32
    tile = tl.program_id(0) * W + e // 32
    g = lane // 4
    t = lane % 4
    row_lo = tile * 16 + g
    c_first = tl.program_id(1) * chunks_per_split
    c0 = tl.zeros((32 * W,), dtype=tl.float32)
    c1 = tl.zeros((32 * W,), dtype=tl.float32)
    c2 = tl.zeros((32 * W,), dtype=tl.float32)
    c3 = tl.zeros((32 * W,), dtype=tl.float32)
    q_lane = q_ptr.to(tl.int64) + ((tile.to(tl.int64) * KC) * 32 + lane) * 16
    x_lane = xf_ptr.to(tl.int64) + lane * 32
    for c in range(c_first, c_first + chunks_per_split, 2):
        w_a = _frag_load(q_lane + c * 512)
        w_b = _frag_load(q_lane + (c + 1) * 512)
        d0 = tl.zeros((32 * W,), dtype=tl.float32)
        d1 = tl.zeros((32 * W,), dtype=tl.float32)
        d2 = tl.zeros((32 * W,), dtype=tl.float32)
        d3 = tl.zeros((32 * W,), dtype=tl.float32)
        d0, d1, d2, d3 = _frag_group(d0, d1, d2, d3, w_a, x_lane + c * 1024)
        d0, d1, d2, d3 = _frag_group(d0, d1, d2, d3, w_b, x_lane + (c + 1) * 1024)
        s_lo = tl.load(s_ptr + row_lo * stride_sn + c // 2).to(tl.float32)
        s_hi = tl.load(s_ptr + (row_lo + 8) * stride_sn + c // 2).to(tl.float32)
        c0 += d0 * s_lo
        c1 += d1 * s_lo
        c2 += d2 * s_hi
        c3 += d3 * s_hi
    tok = 2 * t
    tl.atomic_add(out_ptr + tok * N + row_lo, c0, mask=tok < M, sem="relaxed")
    tl.atomic_add(out_ptr + (tok + 1) * N + row_lo, c1, mask=tok + 1 < M, sem="relaxed")
    tl.atomic_add(out_ptr + tok * N + row_lo + 8, c2, mask=tok < M, sem="relaxed")
    tl.atomic_add(out_ptr + (tok + 1) * N + row_lo + 8, c3, mask=tok + 1 < M, sem="relaxed")


def frag_weights(packed: torch.Tensor) -> torch.Tensor:
    """Row-major packed int4 ``[N, K/2]`` (low nibble = even column) -> the lane-ordered layout of
    :func:`_frag_kernel`, as ``[N/16 * K/64 * 32, 4]`` int32 (tile, chunk, lane, MMA)."""
    n, kb = packed.shape
    k = 2 * kb
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, k).to(torch.int32)
    c = codes.view(n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # tile, row half, g, chunk, mma j, col half, t, col parity
    # byte (half, parity) = code[col half 0] | code[col half 1] << 4
    byte = c[:, :, :, :, :, 0] | (c[:, :, :, :, :, 1] << 4)  # tile, half, g, chunk, j, t, parity
    byte = byte.permute(0, 3, 2, 5, 4, 1, 6)  # tile, chunk, g, t, j, half, parity
    word = byte[..., 0, 0] | (byte[..., 0, 1] << 8) | (byte[..., 1, 0] << 16) | (byte[..., 1, 1] << 24)
    return word.reshape(-1, 4).contiguous()


def frag_x(x: torch.Tensor) -> torch.Tensor:
    """Activations ``[M <= 8, K]`` (bf16) -> lane-ordered B fragments ``[K/64, 32, 4, 2]`` int32: for lane (g, t)
    and MMA j of chunk c, register 0 = x[g, 64c + 16j + 2t : +2], register 1 the same 8 columns on."""
    m, k = x.shape
    xp = torch.zeros(8, k, dtype=x.dtype, device=x.device)
    xp[:m] = x
    pairs = xp.view(8, k // 64, 4, 2, 4, 2)  # g, chunk, j, half, t, pair
    pairs = pairs.permute(1, 0, 4, 2, 3, 5).contiguous()  # chunk, g, t, j, half, pair
    return pairs.view(torch.int32).view(k // 64, 32, 4, 2)


def launch_frag(xf: torch.Tensor, m: int, qf: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                warps: int, split: int) -> None:
    n = out.shape[1]
    kc = xf.shape[0]
    per = kc // split
    out.zero_()
    _frag_kernel[(n // (16 * warps), split)](qf, xf, scales, out, m, n, kc, per, scales.stride(0), W=warps,
                                           num_warps=warps)
