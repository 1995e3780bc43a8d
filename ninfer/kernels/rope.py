"""Partial NeoX rotary embedding with interleaved M-RoPE (reference §7).

Positions arrive as ``[3, N]`` (temporal, height, width); for text all three rows are equal and
the result is plain 1-D RoPE on the first ``rotary_dim`` channels of each head.

The Triton kernel works on rows ``(token, head)`` of ``[N, heads, head_dim]``: each program holds
``BLOCK_R`` whole rows, loads the two rotary halves as separate vectors (so rotate-half needs no
shuffle) and copies the pass-through channels, reading and writing each element once. The same
kernel optionally applies the per-head zero-centred q/k RMSNorm first (:func:`qk_norm_rope`), which
saves a full read and write of q and k, and handles q and k in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.norms import rms_norm_reference
from ninfer.kernels.rowwise import row_block_config


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The ``rotary_dim / 2`` inverse frequencies, fp32, exactly as transformers builds them."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def mrope_cos_sin_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for 3-axis positions ``[3, N]``.

    Frequency index ``j`` belongs to the H axis when ``j % 3 == 1`` (for the first ``3 * sec_h``
    indices), to W when ``j % 3 == 2`` (first ``3 * sec_w``), otherwise to T. The tables are cast to
    the activation dtype before use, as transformers does.
    """
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [3, N, R/2]
    cos, sin = freqs.cos(), freqs.sin()

    def interleave(f: torch.Tensor) -> torch.Tensor:
        out = f[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            idx = slice(offset, mrope_section[axis] * 3, 3)
            out[..., idx] = f[axis, ..., idx]
        return torch.cat((out, out), dim=-1)

    return interleave(cos).to(dtype), interleave(sin).to(dtype)


# Every int and pointer argument unspecialised: one compiled kernel serves every token count and positions
# view (a decode step's, a speculative round's slices), so warm-up meets it once per model.
@triton.jit(do_not_specialize=["pos_ptr", "n", "s_axis", "s_tok"])
def _mrope_table_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, n, s_axis, s_tok,
    HALF: tl.constexpr, H_SECTION: tl.constexpr, W_SECTION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_H)
    axis = tl.where((j % 3 == 1) & (j < 3 * H_SECTION), 1, tl.where((j % 3 == 2) & (j < 3 * W_SECTION), 2, 0))
    mask = (tok < n)[:, None] & (j < HALF)[None, :]
    pos = tl.load(pos_ptr + axis[None, :].to(tl.int64) * s_axis + tok.to(tl.int64)[:, None] * s_tok, mask=mask,
                  other=0)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)[None, :]
    cos, sin = tl.cos(freq).to(cos_ptr.dtype.element_ty), tl.sin(freq).to(sin_ptr.dtype.element_ty)
    out = tok.to(tl.int64)[:, None] * (2 * HALF) + j[None, :]
    for half in tl.static_range(2):  # the table repeats its first half (rotate-half layout)
        tl.store(cos_ptr + out + half * HALF, cos, mask=mask)
        tl.store(sin_ptr + out + half * HALF, sin, mask=mask)


def mrope_cos_sin_triton(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mrope_cos_sin_reference` in one launch (the reference takes about fourteen)."""
    half, n = inv_freq.shape[0], positions.shape[1]
    cos = torch.empty(n, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        block_n = 32
        _mrope_table_kernel[(triton.cdiv(n, block_n),)](
            positions, inv_freq.to(device=positions.device, dtype=torch.float32), cos, sin, n, positions.stride(0),
            positions.stride(1), HALF=half, H_SECTION=mrope_section[1], W_SECTION=mrope_section[2], BLOCK_N=block_n,
            BLOCK_H=triton.next_power_of_2(half), num_warps=4,
        )
    return cos, sin


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for 3-axis positions ``[3, N]`` (:func:`mrope_cos_sin_reference`)."""
    if use_triton(positions):
        return mrope_cos_sin_triton(positions, inv_freq, mrope_section, dtype)
    return mrope_cos_sin_reference(positions, inv_freq, mrope_section, dtype)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of ``x [N, heads, head_dim]``."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


@triton.jit
def norm_rope_rows(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, pid,
    n_rows, heads, D, ROT, eps, sx_n, sx_h, s_cos, s_sin,
    HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program ``pid``'s ``BLOCK_R`` rows ``(token, head)`` of ``x`` into contiguous rows of ``out``."""
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    # Row indices fit int32 (cheap division); offsets are int64, past 2**31 on long prefills.
    tok = (rows // heads).to(tl.int64)
    x_row = (tok * sx_n + (rows % heads).to(tl.int64) * sx_h)[:, None]
    out_row = rows.to(tl.int64)[:, None] * D
    norm_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, x_row, out_row, tok, row_mask, D, ROT, eps, s_cos, s_sin,
                   HAS_NORM, BLOCK_D, BLOCK_H)


@triton.jit
def norm_rope_tile(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, x_row, out_row, tok, row_mask, D, ROT, eps, s_cos, s_sin,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rows starting at ``x_ptr + x_row`` (optionally normalised) with RoPE at token ``tok``'s angles, stored at
    ``out_ptr + out_row`` (``[BLOCK_R, 1]`` offsets: contiguous rows, or a paged cache's slots)."""
    half = ROT // 2
    cols = tl.arange(0, BLOCK_D)[None, :]
    hc = tl.arange(0, BLOCK_H)[None, :]  # channel within a rotary half
    rot_mask = row_mask[:, None] & (hc < half)
    # The pass-through channels (the whole row when it is normalised) and the two rotary halves,
    # each a plain vector load; with the norm the halves re-read the first ROT channels from L1.
    pass_mask = row_mask[:, None] & (cols < D) & (cols >= ROT)
    if HAS_NORM:
        x = tl.load(x_ptr + x_row + cols, mask=row_mask[:, None] & (cols < D), other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + x_row + cols, mask=pass_mask, other=0.0).to(tl.float32)
    lo = tl.load(x_ptr + x_row + hc, mask=rot_mask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + x_row + half + hc, mask=rot_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # Per-head zero-centred RMSNorm; its output is rounded to x's dtype as the unfused path does.
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        w_lo = tl.load(w_ptr + hc, mask=hc < half, other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + half + hc, mask=hc < half, other=0.0).to(tl.float32)
        x = (x * rstd * (1.0 + w)).to(x_ptr.dtype.element_ty).to(tl.float32)
        lo = (lo * rstd * (1.0 + w_lo)).to(x_ptr.dtype.element_ty).to(tl.float32)
        hi = (hi * rstd * (1.0 + w_hi)).to(x_ptr.dtype.element_ty).to(tl.float32)
    # All loads precede the first store (a load cannot be hoisted over a possibly aliasing store).
    cs_row = tok[:, None]
    cos_lo = tl.load(cos_ptr + cs_row * s_cos + hc, mask=rot_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs_row * s_cos + half + hc, mask=rot_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs_row * s_sin + hc, mask=rot_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs_row * s_sin + half + hc, mask=rot_mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_row + cols, x.to(dt), mask=pass_mask)
    # rotate_half(u) = cat(-u_hi, u_lo)
    tl.store(out_ptr + out_row + hc, (lo * cos_lo - hi * sin_lo).to(dt), mask=rot_mask)
    tl.store(out_ptr + out_row + half + hc, (hi * cos_hi + lo * sin_hi).to(dt), mask=rot_mask)


@triton.jit
def _norm_rope_kernel(
    a_ptr, a_w_ptr, a_out_ptr, b_ptr, b_w_ptr, b_out_ptr, cos_ptr, sin_ptr,
    a_rows, a_heads, a_programs, b_rows, b_heads, D, ROT, eps,
    sa_n, sa_h, sb_n, sb_h, s_cos, s_sin,
    HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The first ``a_programs`` programs do the rows of ``a`` (q), the rest those of ``b`` (k): one launch."""
    pid = tl.program_id(0)
    if pid < a_programs:
        norm_rope_rows(a_ptr, a_w_ptr, cos_ptr, sin_ptr, a_out_ptr, pid, a_rows, a_heads, D, ROT, eps,
                        sa_n, sa_h, s_cos, s_sin, HAS_NORM, BLOCK_R, BLOCK_D, BLOCK_H)
    else:
        norm_rope_rows(b_ptr, b_w_ptr, cos_ptr, sin_ptr, b_out_ptr, pid - a_programs, b_rows, b_heads, D, ROT,
                        eps, sb_n, sb_h, s_cos, s_sin, HAS_NORM, BLOCK_R, BLOCK_D, BLOCK_H)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    a: torch.Tensor, b: torch.Tensor | None, a_w: torch.Tensor | None, b_w: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    a, cos, sin = _unit_last_stride(a), _unit_last_stride(cos), _unit_last_stride(sin)
    b = None if b is None else _unit_last_stride(b)
    a_w = None if a_w is None else a_w.contiguous()
    b_w = None if b_w is None else b_w.contiguous()
    out_dtype = torch.promote_types(a.dtype, cos.dtype)
    a_out = torch.empty(a.shape, dtype=out_dtype, device=a.device)
    b_out = None if b is None else torch.empty(b.shape, dtype=torch.promote_types(b.dtype, cos.dtype), device=b.device)
    n, a_heads, d = a.shape
    b_heads = 0 if b is None else b.shape[1]
    if n == 0:
        return a_out, b_out
    rot = cos.shape[-1]
    block_r, block_d, _, num_warps = row_block_config(d, n * a_heads, max(2048, triton.next_power_of_2(d)))
    a_programs = triton.cdiv(n * a_heads, block_r)
    grid = (a_programs + triton.cdiv(n * b_heads, block_r),)
    bb, bo, bw = (a, a_out, a_w) if b is None else (b, b_out, b_w)
    _norm_rope_kernel[grid](
        a, a if a_w is None else a_w, a_out, bb, bb if bw is None else bw, bo, cos, sin,
        n * a_heads, a_heads, a_programs, n * b_heads, max(b_heads, 1), d, rot, eps,
        a.stride(0), a.stride(1), bb.stride(0), bb.stride(1), cos.stride(0), sin.stride(0),
        HAS_NORM=a_w is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        BLOCK_H=triton.next_power_of_2(max(rot // 2, 1)), num_warps=num_warps,
    )
    return a_out, b_out


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton :func:`apply_rope_reference` for ``x [N, heads, head_dim]`` (strided rows fine); new tensor."""
    return _launch(x, None, None, None, cos, sin, 0.0)[0]


def qk_norm_rope_reference(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head zero-centred RMSNorm of ``q [N, hq, dh]`` and ``k [N, hk, dh]``, then partial RoPE."""
    q = rms_norm_reference(q, q_weight, eps)[0]
    k = rms_norm_reference(k, k_weight, eps)[0]
    return apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)


def qk_norm_rope_triton(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`qk_norm_rope_reference`: one launch for both q and k; strided q/k views fine."""
    q_out, k_out = _launch(q, k, q_weight, k_weight, cos, sin, eps)
    assert k_out is not None
    return q_out, k_out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return apply_rope_triton(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)
