"""Launch helpers shared by the row-parallel elementwise kernels (norms, RoPE, SwiGLU).

Row kernels see a tensor ``[..., D]`` as ``[A, B, D]`` with two row strides, so strided views such
as the query half of the interleaved q_proj output (``view(N, heads, 2 * dh)[..., :dh]``) run in
place without a copy; row ``r`` lives at ``(r // B) * stride_a + (r % B) * stride_b``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def as_rows_3d(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` as ``[A, B, D]`` with a unit last stride; a view unless the layout forbids one."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def row_block_config(d: int, n_rows: int, elements: int = 2048) -> tuple[int, int, int, int]:
    """``(BLOCK_R, BLOCK_D, NUM_CHUNKS, num_warps)`` for a row kernel over ``n_rows`` rows of ``d``.

    About ``elements`` values per program at 8 per thread (one 16-byte bf16 vector), which keeps
    registers low enough for several programs per SM and so enough bytes in flight. Rows up to
    ``elements`` wide are held whole (small rows batched ``BLOCK_R`` per program); a wider row gets
    one program of 4 warps and ``NUM_CHUNKS`` chunks of 1024 (5120 = 5 chunks, no padding to 8192).
    """
    block_d = triton.next_power_of_2(d)
    if block_d > elements:
        return 1, 1024, triton.cdiv(d, 1024), 4
    block_r = max(1, min(elements // block_d, triton.next_power_of_2(max(n_rows, 1))))
    return block_r, block_d, 1, max(1, min(16, block_r * block_d // 256))
