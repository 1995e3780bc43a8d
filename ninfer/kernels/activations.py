"""SwiGLU: ``silu(gate) * up``; the MoE shared expert's gated add: ``base + sigmoid(g) * x``.

Both Triton kernels are 2-D elementwise passes (rows x column blocks of ``BLOCK`` outputs) that read
each input once and write once, rounding every intermediate to the input dtype exactly as the
multi-op reference does: the same bits in one launch. The gated add replaces three launches per MoE
layer (sigmoid, multiply, add), which at batch-1 decode cost more in launch gaps than in bytes.
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


def sigmoid_gated_add_reference(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``base + sigmoid(gate) * x`` with ``gate [..., 1]`` broadcast over the rows of ``base`` / ``x``."""
    return base + torch.sigmoid(gate) * x


@triton.jit
def _gated_add_kernel(base_ptr, gate_ptr, x_ptr, out_ptr, width, s_base, s_gate, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * s_gate).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    base = tl.load(base_ptr + row * s_base + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (base + (s * x).to(dt).to(tl.float32)).to(dt), mask=mask)


def sigmoid_gated_add_triton(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`sigmoid_gated_add_reference` for 2-D ``base``, ``x [T, H]`` and ``gate [T, 1]`` (rows may
    be strided; unit last stride), all of one dtype."""
    t, width = base.shape
    if gate.shape != (t, 1) or x.shape != (t, width) or not (base.dtype == gate.dtype == x.dtype):
        raise ValueError(f"sigmoid_gated_add: base {tuple(base.shape)} {base.dtype}, gate {tuple(gate.shape)} "
                         f"{gate.dtype}, x {tuple(x.shape)} {x.dtype}: want [T, H], [T, 1], [T, H] of one dtype")
    out = torch.empty((t, width), dtype=base.dtype, device=base.device)
    if out.numel() == 0:
        return out
    base, x = (v if v.stride(-1) == 1 else v.contiguous() for v in (base, x))
    block = min(_BLOCK, triton.next_power_of_2(width))
    _gated_add_kernel[(t, triton.cdiv(width, block))](
        base, gate, x, out, width, base.stride(0), gate.stride(0), x.stride(0), BLOCK=block,
        num_warps=max(1, min(_NUM_WARPS, block // 256)),
    )
    return out


def sigmoid_gated_add(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if use_triton(base) and base.dim() == 2:
        return sigmoid_gated_add_triton(base, gate, x)
    return sigmoid_gated_add_reference(base, gate, x)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return swiglu_triton(gate_up)
    return swiglu_reference(gate_up)
