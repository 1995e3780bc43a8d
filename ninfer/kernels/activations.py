"""SwiGLU: ``silu(gate) * up``.

The Triton kernel is a 2-D elementwise pass (rows x column blocks of ``BLOCK`` outputs): it reads the
gate and up halves of a row once and writes the product once, rounding ``silu(gate)`` to the input
dtype before the product exactly as the two-op reference does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2I]`` holds gate in its first half and up in its second."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, inter, s_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int32 offsets overflow for long prefills (N * 2I > 2**31)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * s_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


# 1024 outputs per program with 4 warps: 8 values (16 B of bf16) per thread and load.
_BLOCK, _NUM_WARPS = 1024, 4


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`swiglu_reference`; rows of ``gate_up`` may be strided (unit last stride)."""
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    x = x.reshape(-1, 2 * inter)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _swiglu_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), BLOCK=block, num_warps=max(1, min(_NUM_WARPS, block // 256)),
    )
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return swiglu_triton(gate_up)
    return swiglu_reference(gate_up)
