"""int4 decode GEMM on tensor cores: ``y = x @ W^T`` for up to 8 (16, 32) tokens at the cost of one.

The plain GEMV (:mod:`ninfer.kernels.quant_gemm.gemv`) multiplies on the FMA pipe, so its instructions grow
with the token count (M = 8 took 5.7x the M = 1 time). This kernel hands the products to the MMA
(``tl.dot``) with the weight rows on the MMA's M side ("swap AB": a program owns a ``y^T [BLOCK_N,
TOKENS]`` tile, ``TOKENS`` = 8, 16 or 32 = ``GemmConfig.block_m``), so the per-weight work is the decode
alone and does not depend on the token count:

* The packed bytes go through Triton's software pipeline (``cp.async`` into shared memory,
  ``num_stages`` deep: many loads in flight without registers) and come back still packed in the MMA
  operand layout: Triton hoists the layout conversion above the elementwise decode (offline TTGIR:
  ``local_load`` of the ``i8`` tile into ``dot_op``, then the decode, then the dot).
* :func:`_codes` turns four bytes (one 32-bit register) into four exact ``nibble - 8`` values of the
  activation dtype: ``prmt`` moves two bytes into the two halves of a word, ``lop3`` masks a nibble into
  the mantissa of ``2^7`` (bf16) or ``2^10`` (fp16), giving ``128 + nibble``, and one packed ``fma``
  subtracts ``136`` (``1032``) from both halves: no int->float conversion instruction. Each output
  depends on its own byte only, so the result cannot depend on how Triton groups elements in registers.
* The low nibbles (even columns) and the high nibbles (odd columns) of a scale group are two dots against
  the even and odd activation columns, which one 32-bit load per column pair provides; each group's
  fp32 product is scaled once per ``[BLOCK_N, TOKENS]`` tile, not per weight, with scales loaded one K
  step ahead (they feed no dot, so the pipeline does not stage them).
* ``mma.sync`` (``kWidth = 4``: four consecutive bytes per thread, ``ldmatrix`` loads) spends 2.2-2.7
  instructions per weight in the K loop at 8 tokens (sm_90 SASS, ``perf/ptx_check.py --kinds gemv-mma``); Hopper's wgmma takes its A operand with ``kWidth = 2``,
  which costs a 2-byte shared load and a byte permute per pair (~5 per weight), so the configs use one or
  two warps (no warpgroup: Triton then emits ``mma.sync``, as it does on every other GPU).

Everything after the K loop (split-K partials, arrival counters, the last split's sum, SwiGLU and
residual epilogues) is :mod:`ninfer.kernels.quant_gemm.gemv`'s. The decode is inline PTX, which the Triton
interpreter cannot run: there (``ASM=False``) the same values come from Triton bit operations, so CPU
tests check the kernel's indexing and epilogues and the GPU tests check the PTX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.quant_gemm.common import int4_values
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import gemv_epilogue, reduce_splits
from ninfer.kernels.quant_gemm.tune import GemmConfig

# Low / high nibbles of bytes 0, 1 (output word 0) and 2, 3 (output word 1) of $2 -> ``nibble - 8`` in the
# two 16-bit halves of each word. ``prmt`` selector 0x4140 puts byte 0 in the low half and byte 1 in the
# high half (the 4s select zero bytes of the second operand), 0x4342 bytes 2 and 3; lop3 0xEA = (a & b) | c.
_DECODE = """{{
    .reg .b32 w, t, one, bias;
    mov.b32 one, {one};
    mov.b32 bias, {bias};
    {shift}
    prmt.b32 t, w, 0, 0x4140;
    lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;
    fma.rn.{ty} $0, t, one, bias;
    prmt.b32 t, w, 0, 0x4342;
    lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;
    fma.rn.{ty} $1, t, one, bias;
}}"""
_CONSTS = {  # (1.0, -(2^e + 8), 2^e) as packed pairs
    "bf16x2": ("0x3F803F80", "0xC308C308", "0x43004300"),
    "f16x2": ("0x3C003C00", "0xE408E408", "0x64006400"),
}


def _decode_asm(ty: str, high: bool) -> str:
    one, bias, magic = _CONSTS[ty]
    shift = "shr.u32 w, $2, 4;" if high else "mov.b32 w, $2;"
    return _DECODE.format(one=one, bias=bias, magic=magic, ty=ty, shift=shift)


BF16_LO, BF16_HI = tl.constexpr(_decode_asm("bf16x2", False)), tl.constexpr(_decode_asm("bf16x2", True))
F16_LO, F16_HI = tl.constexpr(_decode_asm("f16x2", False)), tl.constexpr(_decode_asm("f16x2", True))


@triton.jit
def _codes(packed, HIGH: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """``nibble - 8`` of each byte's low (or high) nibble, exact in DTYPE (bf16 or fp16)."""
    if ASM:
        if DTYPE == tl.bfloat16:
            if HIGH:
                v = tl.inline_asm_elementwise(BF16_HI, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
            else:
                v = tl.inline_asm_elementwise(BF16_LO, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            if HIGH:
                v = tl.inline_asm_elementwise(F16_HI, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
            else:
                v = tl.inline_asm_elementwise(F16_LO, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
    else:
        v = int4_values((packed >> 4) if HIGH else (packed & 0xF), DTYPE)
    return v


@triton.jit
def _group_dot(acc, q_ptr, rows, kg, xe, xo, scales, g: tl.constexpr, stride_qn, GROUP: tl.constexpr,
               ASM: tl.constexpr):
    """``acc += scale * (W[rows, kg:kg+GROUP] @ x^T)`` for one scale group, the step's ``g``-th: even columns
    from the low nibbles against ``xe``, odd columns from the high nibbles against ``xo`` (``[GROUP / 2,
    TOKENS]``); ``scales`` holds the step's ``[BLOCK_N, groups]`` fp32 scales."""
    packed = tl.load(q_ptr + rows[:, None] * stride_qn + (kg // 2 + tl.arange(0, GROUP // 2))[None, :])
    part = tl.dot(_codes(packed, False, xe.dtype, ASM), xe)
    part = tl.dot(_codes(packed, True, xe.dtype, ASM), xo, part)
    column = tl.arange(0, scales.shape[1])[None, :] == g
    return acc + part * tl.sum(tl.where(column, scales, 0.0), axis=1)[:, None]


@triton.jit
def _step_scales(s_ptr, rows, k0, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 scales ``[BLOCK_N, BLOCK_K / GROUP]`` of the K step at ``k0``."""
    cols = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    return tl.load(s_ptr + rows[:, None] * stride_sn + cols[None, :]).to(tl.float32)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _quant_gemv_mma_kernel(
    x_ptr, q_ptr, s_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N_OUT, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    GROUP: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    rows = tl.minimum(offs_n, N_OUT - 1)  # clamped rows and tokens load valid memory; the store drops them
    xrows = tl.minimum(offs_m, M - 1)
    acc = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    # A product with BLOCK_K proves every k0 a multiple of it (16-byte aligned packed rows); the launcher
    # makes k_per_split and K multiples of BLOCK_K, itself a multiple of GROUP.
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    k_last = tl.minimum(k_first + k_per_split, K)
    # x read as 32-bit words, each an (even, odd) column pair: one vector load per thread, split in registers
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + xrows.to(tl.int64)[None, :] * (stride_xm // 2)
    # The scales are loaded one K step ahead (the pipeline stages only what feeds the dots; a scale load
    # waited on inside its own step would stall every group).
    up_rows = rows + N_OUT  # SwiGLU: the up rows of the same output columns, N_OUT rows further down
    scales = _step_scales(s_ptr, rows, k_first, stride_sn, GROUP, BLOCK_K)
    scales_up = _step_scales(s_ptr, up_rows, k_first, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales
    for k0 in range(k_first, k_last, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last - BLOCK_K)  # the last step reloads its own
        scales_next = _step_scales(s_ptr, rows, k_next, stride_sn, GROUP, BLOCK_K)
        scales_up_next = _step_scales(s_ptr, up_rows, k_next, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales_next
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP
            pairs = tl.load(x_words + (kg // 2 + tl.arange(0, GROUP // 2))[:, None])  # [GROUP / 2, TOKENS]
            xe = (pairs & 0xFFFF).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            xo = (pairs >> 16).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            acc = _group_dot(acc, q_ptr, rows, kg, xe, xo, scales, g, stride_qn, GROUP, ASM)
            if SWIGLU:
                acc_up = _group_dot(acc_up, q_ptr, up_rows, kg, xe, xo, scales_up, g, stride_qn, GROUP, ASM)
        scales = scales_next
        scales_up = scales_up_next
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc_up, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, res_ptr, stride_rm, out_ptr,
                   stride_om, SPLIT, FUSED_REDUCE, SWIGLU, HAS_RES, BLOCK_N, TOKENS)


def mma_supported(x_dtype: torch.dtype, k: int, group: int, block_k: int) -> bool:
    """Whether :func:`launch_gemv_mma` takes this call: 16-bit activations and whole K steps."""
    return x_dtype in (torch.bfloat16, torch.float16) and block_k % group == 0 and k % block_k == 0


def launch_gemv_mma(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, res: torch.Tensor | None,
                    out: torch.Tensor, swiglu: bool, group: int, cfg: GemmConfig) -> None:
    """Launch the tensor-core int4 decode GEMM (``cfg.kind == "gemv-mma"``) with the tensors
    ``quant_gemm._launch`` prepared; ``cfg.block_k`` is a multiple of the scale group."""
    m, k = x.shape
    n_out = out.shape[1]
    if x.data_ptr() % 4 or x.stride(0) % 2:  # the kernel reads x as 32-bit column pairs
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    if not mma_supported(x.dtype, k, group, cfg.block_k):
        raise ValueError(f"gemv-mma needs bf16/fp16 activations and K ({k}) a multiple of block_k {cfg.block_k}, "
                         f"itself a multiple of the group {group}; got {x.dtype}")
    k_steps = k // cfg.block_k
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    ws = torch.empty(splits, m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    res_arg = res if res is not None else out
    grid = (triton.cdiv(n_out, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    counters = tile_counters(x.device, grid[0] * grid[2]) if splits > 1 else None
    _quant_gemv_mma_kernel[grid](
        x_ptr=x, q_ptr=q, s_ptr=scales, res_ptr=res_arg, out_ptr=out, ws_ptr=ws, cnt_ptr=counters, M=m, N_OUT=n_out,
        K=k, k_per_split=per_split * cfg.block_k, stride_xm=x.stride(0), stride_qn=q.stride(-2),
        stride_sn=scales.stride(-2), stride_rm=res_arg.stride(0), stride_om=out.stride(0), GROUP=group,
        SWIGLU=swiglu, HAS_RES=res is not None, SPLIT=splits > 1, FUSED_REDUCE=counters is not None,
        TOKENS=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ASM=not INTERPRET, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    if splits > 1 and counters is None:
        reduce_splits(ws, res_arg, out, m, splits, swiglu, res is not None)
