"""Rows of a quantized embedding table in one launch: the token embedding lookup of the shipped recipes.

The recipes store ``embed_tokens`` as int8 with fp16 group scales (``int8-g64`` / ``-g32``) or as fp8 with one
fp32 scale per row. Dequantizing the looked-up rows with torch ops (two gathers, code and scale casts, the scales
repeated per group, a product, the cast to the activation dtype) is about eight launches per forward: every decode
step and each step of a speculative round begins with them. Here one program per (token, column block) reads its
codes and scales and writes ``codes * scale`` in the activation dtype, exactly the reference's fp32 product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton

INT8, INT4, FP8_ROW = 0, 1, 2  # the code kinds the kernel decodes


def code_kind(qweight: torch.Tensor, scales: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """``(kind, group)`` of a row-major table whose codes and scales the kernel reads, or None: int8 / int4 codes
    with fp16 group scales (``[N, K]`` int8 or ``[N, K / 2]`` uint8, scales ``[N, K / G]``), fp8 codes with one
    fp32 scale per row."""
    n = qweight.shape[0]
    if qweight.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == (n,):
        return FP8_ROW, dim
    if scales.dtype != torch.float16 or scales.dim() != 2 or scales.shape[0] != n or dim % scales.shape[1]:
        return None
    group = dim // scales.shape[1]
    if qweight.dtype == torch.int8 and qweight.shape == (n, dim):
        return INT8, group
    if qweight.dtype == torch.uint8 and qweight.shape == (n, dim // 2) and group % 2 == 0:
        return INT4, group
    return None


# One compiled kernel per table (its kind, group and width): ids and outputs unspecialised.
@triton.jit(do_not_specialize=["ids_ptr", "out_ptr"])
def _embedding_rows_kernel(
    ids_ptr, q_ptr, s_ptr, out_ptr, DIM: tl.constexpr, GROUP: tl.constexpr, KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < DIM
    row = tl.load(ids_ptr + t).to(tl.int64)
    if KIND == 1:  # int4: column 2i in the low nibble of byte i, stored with +8
        byte = tl.load(q_ptr + row * (DIM // 2) + cols // 2, mask=ok, other=0).to(tl.int32)
        q = ((byte >> ((cols % 2) * 4)) & 0xF) - 8
    else:
        q = tl.load(q_ptr + row * DIM + cols, mask=ok)  # masked columns are never stored
    if KIND == 2:
        scale = tl.load(s_ptr + row)
    else:
        scale = tl.load(s_ptr + row * (DIM // GROUP) + cols // GROUP, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * DIM + cols, (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
             mask=ok)


def embedding_rows_triton(qweight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dim: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids [T]`` of the table, dequantized ``[T, dim]`` in ``dtype`` (:func:`code_kind` must accept it)."""
    kind = code_kind(qweight, scales, dim)
    assert kind is not None and qweight.is_contiguous() and scales.is_contiguous()
    out = torch.empty(ids.shape[0], dim, dtype=dtype, device=qweight.device)
    if ids.shape[0]:
        block = min(1024, triton.next_power_of_2(dim))
        _embedding_rows_kernel[(ids.shape[0], triton.cdiv(dim, block))](
            ids, qweight, scales, out, DIM=dim, GROUP=kind[1], KIND=kind[0], BLOCK=block, num_warps=4)
    return out


def can_take(qweight: torch.Tensor, scales: torch.Tensor, dim: int) -> bool:
    """Whether :func:`embedding_rows_triton` serves this table on its device."""
    return use_triton(qweight) and qweight.is_contiguous() and scales.is_contiguous() and \
        code_kind(qweight, scales, dim) is not None
