"""RMSNorm variants of the Qwen3.5 text model.

Two kinds exist and must never be mixed up (reference §5): the zero-centred norm scales by
``1 + w`` and is used everywhere except the Gated DeltaNet output, whose gated norm scales by a
plain ``w`` and then multiplies by ``silu(z)``.

The Triton kernels are row-parallel with fp32 math and outputs in the input dtype. Rows are held
whole in registers, so every byte is read and written once: up to 2048 wide, ``BLOCK_R`` rows per
program; a wider row (the 5120 hidden size) gets one program and is kept as a tuple of 1024-wide
chunks (no padding of 5120 up to 8192). Roundings the reference performs in the model dtype are repeated in-kernel,
so bf16 results match it to the last bit except for transcendental-function differences.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.pdl import pdl_enter, small_kernel_pdl
from ninfer.kernels.rowwise import TL_DTYPE, as_rows_3d, row_block_config


@dataclass(frozen=True)
class NextNorm:
    """The zero-centred RMSNorm that follows an op, for the op to apply in its own last launch: the norm's
    ``weight`` and ``eps``, the ``residual`` stream to add first (or None) and the buffer the new residual stream
    (``x + residual``, as :func:`rms_norm` returns it) is written to."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    new_residual: torch.Tensor


@dataclass(frozen=True)
class NormedRows:
    """A zero-centred RMSNorm's output with its one per-row factor left to the kernels that read it (a deferred
    norm): ``scaled = h * (1 + w)`` in the model dtype, and each row's sum of squares of ``h`` in parts, ``stats
    [parts, N]`` (fp32), so that ``norm(h)[m] = scaled[m] * rsqrt(sum(stats[:, m]) / D + eps)``. A GEMM that reads
    it multiplies its fp32 sums by the row's factor (it is linear in the row), so that the producer of ``h`` writes
    both and the norm needs no launch of its own; :meth:`materialize` is the norm's output for every other reader.
    ``shape`` / ``dtype`` / ``device`` / ``is_cuda`` are those of the normed rows."""

    scaled: torch.Tensor
    stats: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.scaled.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.scaled.dtype

    @property
    def device(self) -> torch.device:
        return self.scaled.device

    @property
    def is_cuda(self) -> bool:
        return self.scaled.is_cuda

    def over(self, scaled: torch.Tensor) -> NormedRows:
        """The same rows held in ``scaled`` (a copy or a reshaped view of ``self.scaled``, rows in the same order)."""
        return replace(self, scaled=scaled)

    def rstd(self) -> torch.Tensor:
        """Each row's ``rsqrt(mean(h^2) + eps)``, fp32 ``[N]``."""
        return torch.rsqrt(self.stats.sum(0) / self.scaled.shape[-1] + self.eps)

    def materialize(self) -> torch.Tensor:
        """The normed rows as :func:`rms_norm` returns them (up to the rounding of ``scaled``)."""
        return (self.scaled.float() * self.rstd()[:, None]).to(self.scaled.dtype)


def as_rows(x: torch.Tensor | NormedRows) -> torch.Tensor:
    """``x``, or the normed rows it defers (:meth:`NormedRows.materialize`), for readers that take plain tensors."""
    return x.materialize() if isinstance(x, NormedRows) else x


def deferred_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                            parts: int) -> tuple[NormedRows, torch.Tensor]:
    """:func:`rms_norm_reference` in the deferred form, its sums of squares over ``parts`` column ranges (as equal as
    :func:`torch.tensor_split` makes them)."""
    h = x if residual is None else x + residual
    hf = h.float()
    scaled = (hf * (1.0 + weight.float())).to(h.dtype)
    stats = torch.stack([part.pow(2).sum(-1) for part in hf.tensor_split(parts, dim=-1)])
    return NormedRows(scaled, stats, eps), h


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim with an optional residual add first.

    Returns ``(normed, new_residual)`` where ``new_residual = x + residual`` (or ``x``), kept in the
    input dtype as the model's residual stream is.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype), x


def gated_rms_norm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the DeltaNet output: ``w * norm(x)`` (cast to x's dtype first) times ``silu(z)``."""
    dtype = x.dtype
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    out = weight * h
    return (out * F.silu(z.float())).to(dtype)


@triton.jit
def _row_offsets(pid, n_rows, rows_b, stride_a, stride_b, BLOCK_R: tl.constexpr):
    """Element offsets of the rows of block ``pid`` in an ``[A, B, D]`` tensor, and their mask."""
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < n_rows
    # Row indices fit int32 (cheap division); offsets are int64, past 2**31 on long prefills.
    offs = (rows // rows_b).to(tl.int64) * stride_a + (rows % rows_b).to(tl.int64) * stride_b
    return offs, rows.to(tl.int64), mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    n_rows, rows_b, D, eps,
    sx_a, sx_b, sr_a, sr_b,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """``BLOCK_R`` rows of ``NUM_CHUNKS * BLOCK_D`` channels, held in registers as a tuple of chunks.
    ``PDL_TRIGGER``: let the next kernel launch now (programmatic dependent launch: a GEMM that requests its
    weights while this runs, and waits for this kernel's outputs before it reads them); ``PDL_WAIT``: this one was
    launched so (:mod:`ninfer.kernels.pdl`)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    pid = tl.program_id(0)
    x_off, rows, row_mask = _row_offsets(pid, n_rows, rows_b, sx_a, sx_b, BLOCK_R)
    r_off, _, _ = _row_offsets(pid, n_rows, rows_b, sr_a, sr_b, BLOCK_R)
    out_row = rows[:, None] * D  # outputs are allocated contiguous
    cols = tl.arange(0, BLOCK_D)
    # Every load is issued before the first store: the compiler may not move a load over a store
    # (the pointers could alias), and one round trip per row matters at decode sizes.
    xs, rs, ws = (), (), ()
    for c in tl.static_range(NUM_CHUNKS):
        cc = c * BLOCK_D + cols
        mask = row_mask[:, None] & (cc < D)[None, :]
        ws = ws + (tl.load(w_ptr + cc, mask=cc < D, other=0.0),)
        xs = xs + (tl.load(x_ptr + x_off[:, None] + cc[None, :], mask=mask, other=0.0),)
        if HAS_RESIDUAL:
            rs = rs + (tl.load(res_ptr + r_off[:, None] + cc[None, :], mask=mask, other=0.0),)
    hs = ()
    sq = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)  # summed across chunks, reduced once
    for c in tl.static_range(NUM_CHUNKS):
        h = xs[c].to(tl.float32)
        if HAS_RESIDUAL:
            cc = c * BLOCK_D + cols
            # The residual stream lives in the model dtype: round the sum before normalising it.
            s = (h + rs[c].to(tl.float32)).to(new_res_ptr.dtype.element_ty)
            tl.store(new_res_ptr + out_row + cc[None, :], s, mask=row_mask[:, None] & (cc < D)[None, :])
            h = s.to(tl.float32)
        hs = hs + (h,)
        sq += h * h
    rstd = tl.rsqrt(tl.sum(sq, axis=1) / D + eps)[:, None]
    for c in tl.static_range(NUM_CHUNKS):
        cc = c * BLOCK_D + cols
        y = hs[c] * rstd * (1.0 + ws[c].to(tl.float32)[None, :])
        tl.store(out_ptr + out_row + cc[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cc < D)[None, :])


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    n_rows, rows_b, D, eps,
    sx_a, sx_b, sz_a, sz_b,
    PROD_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL_WAIT: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = False,
):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # as in _rms_norm_kernel
    pid = tl.program_id(0)
    x_off, rows, row_mask = _row_offsets(pid, n_rows, rows_b, sx_a, sx_b, BLOCK_R)
    z_off, _, _ = _row_offsets(pid, n_rows, rows_b, sz_a, sz_b, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    h = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + z_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    # Reference order: normed value cast to x's dtype, times w in promote(w, x) dtype, then the
    # fp32 product with silu(z) cast back.
    n = (h * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    g = (w[None, :] * n).to(PROD_DTYPE).to(tl.float32)
    y = g * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rms_norm_reference`; ``x`` and ``residual`` may be strided views (unit last stride)."""
    dtype = x.dtype if residual is None else torch.result_type(x, residual)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    new_res = x if residual is None else torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out, new_res
    x3, weight = as_rows_3d(x), weight.contiguous()
    r3 = as_rows_3d(residual) if residual is not None else x3
    n_rows, rows_b, d = x3.shape[0] * x3.shape[1], x3.shape[1], x3.shape[2]
    block_r, block_d, num_chunks, num_warps = row_block_config(d, n_rows)
    pdl = small_kernel_pdl(x.device)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, r3, weight, out, new_res, n_rows, rows_b, d, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_D=block_d, NUM_CHUNKS=num_chunks,
        **pdl.constexprs(), **pdl.options(), num_warps=num_warps,
    )
    return out, new_res


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`gated_rms_norm_reference`; ``x`` and ``z`` ``[..., D]`` may be row-strided views."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3, z3, weight = as_rows_3d(x), as_rows_3d(z.expand(x.shape)), weight.contiguous()
    n_rows, rows_b, d = x3.shape[0] * x3.shape[1], x3.shape[1], x3.shape[2]
    block_r, block_d, num_chunks, num_warps = row_block_config(d, n_rows, elements=max(2048, triton.next_power_of_2(d)))
    assert num_chunks == 1, "gated_rms_norm keeps whole rows in registers"
    pdl = small_kernel_pdl(x.device)
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, z3, weight, out, n_rows, rows_b, d, eps,
        x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        PROD_DTYPE=TL_DTYPE[torch.promote_types(weight.dtype, x.dtype)],
        BLOCK_R=block_r, BLOCK_D=block_d, **pdl.constexprs(), **pdl.options(), num_warps=num_warps,
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_reference(x, z, weight, eps)
