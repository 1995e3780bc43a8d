"""Pieces every quantized GEMM/GEMV kernel shares: the formats' kernel codes, the bit-pattern decoders of
packed weights, the dequantized weight tile, the epilogue (SwiGLU, residual, store) and the split-K
finish kernel, and the kernels' view of a :class:`QuantizedTensor`.

Dequantization avoids int->float conversion instructions (bit-pattern tricks, see the helpers): at decode
the ALU work per weight byte, not the MMA, competes with the memory stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.e2m1 import e2m1_values
from ninfer.kernels.quant_gemm.weights import QuantizedTensor


FMT_CODES = {"fp8": 0, "fp8-b128": 1, "int8-g32": 2, "int8-g64": 2, "int4-g64": 3, "int4-g128": 3, "nvfp4": 4}


# Kernel-side format codes (the values of FMT_CODES).
FMT_FP8, FMT_FP8_B128, FMT_INT8, FMT_INT4, FMT_NVFP4 = (tl.constexpr(i) for i in range(5))


@triton.jit
def int4_values(nib, DTYPE: tl.constexpr):
    """Offset-binary nibbles -> exact signed values in DTYPE, read from the bit pattern of ``2^e + nibble``
    (no int->float conversion instruction: it issues at a quarter of the FMA rate)."""
    if DTYPE == tl.bfloat16:
        v = (nib.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0  # 128 + nibble - 8
    elif DTYPE == tl.float16:
        v = (nib.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0  # 1024 + nibble - 8
    else:
        v = (nib.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + nibble - 8
    return v


@triton.jit
def group_scales(s_ptr, rows, k0, K, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
                  N_GROUPS: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 scales ``[BLOCK_N, N_GROUPS]`` of the groups starting at column k0."""
    cols = k0 // GROUP + tl.arange(0, N_GROUPS)
    ptrs = s_ptr + (rows // ROW_BLOCK)[:, None] * stride_sn + cols[None, :]
    if EVEN_K:
        scale = tl.load(ptrs)
    else:
        scale = tl.load(ptrs, mask=cols[None, :] < tl.cdiv(K, GROUP), other=0)
    if FMT == FMT_NVFP4:
        scale = scale.to(tl.float8e4nv, bitcast=True)  # fp8 travels as uint8 (portable loads and masks)
    return scale.to(tl.float32)


@triton.jit
def weight_tile(q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn,
                 FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
                 SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """Weight rows ``rows``, columns ``[k0, k0 + BLOCK_K)`` as a ``[BLOCK_N, BLOCK_K]`` DOT_DTYPE tile.

    SCALED: dequantized (group scales of CHUNK columns applied in fp32). Otherwise the exact codes
    (integers, fp8 values) of one scale group, whose scale the caller applies to the dot product.
    Rows must be valid indices (callers clamp them), so only a ragged K needs a mask.
    """
    N_GROUPS: tl.constexpr = BLOCK_K // CHUNK
    if FMT == FMT_INT4 or FMT == FMT_NVFP4:
        offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ptrs = q_ptr + rows[:, None] * stride_qn + offs[None, :]
        packed = tl.load(ptrs) if EVEN_K else tl.load(ptrs, mask=offs[None, :] < K // 2, other=0)
        lo, hi = packed & 0xF, packed >> 4
        if FMT == FMT_NVFP4:  # times 2^126: exact values (a scale that large would overflow)
            lo, hi = e2m1_values(lo) * 8.507059173023462e37, e2m1_values(hi) * 8.507059173023462e37
        elif SCALED:
            lo, hi = int4_values(lo, tl.float32), int4_values(hi, tl.float32)
        else:
            lo, hi = int4_values(lo, DOT_DTYPE), int4_values(hi, DOT_DTYPE)
        if SCALED:
            scale = group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, N_GROUPS, EVEN_K)
            lo = tl.reshape(lo, (BLOCK_N, N_GROUPS, CHUNK // 2)) * scale[:, :, None]
            hi = tl.reshape(hi, (BLOCK_N, N_GROUPS, CHUNK // 2)) * scale[:, :, None]
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # element 2j from the low nibble, 2j + 1 from the high
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        ptrs = q_ptr + rows[:, None] * stride_qn + offs[None, :]
        q = tl.load(ptrs) if EVEN_K else tl.load(ptrs, mask=offs[None, :] < K, other=0)
        if FMT == FMT_INT8:
            q = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0  # exact, as for int4
        else:
            q = q.to(tl.float8e4nv, bitcast=True)  # fp8 travels as uint8 (portable loads and masks)
        if SCALED:
            scale = group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, N_GROUPS, EVEN_K)
            q = tl.reshape(q.to(tl.float32), (BLOCK_N, N_GROUPS, CHUNK)) * scale[:, :, None]
        w = tl.reshape(q, (BLOCK_N, BLOCK_K))
    return w.to(DOT_DTYPE)


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` on tensor cores; with IEEE (fp32 activations) in full fp32, no silent tf32."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_tile(pid, M, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)``, the token block and weight block of program ``pid`` in grouped order: GROUP_M token
    blocks sweep the weight blocks together, so the activations of a group and each weight block stay in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om,
            SWIGLU: tl.constexpr, HAS_RES: tl.constexpr):
    """Epilogue on a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` (fp32): SwiGLU, residual add, store."""
    finish_at(acc, acc_up, offs_m[None, :], offs_n[:, None], mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU,
              HAS_RES)


@triton.jit
def finish_at(acc, acc_up, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om,
              SWIGLU: tl.constexpr, HAS_RES: tl.constexpr):
    """:func:`finish` for values at any positions: ``acc`` (fp32) is ``y[m_idx, n_idx]`` (index tensors that
    broadcast to its shape)."""
    y = acc
    if SWIGLU:
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
    m64 = m_idx.to(tl.int64)  # M * N reaches 2^31 for long prompts through the LM head
    if HAS_RES:
        y += tl.load(res_ptr + m64 * stride_rm + n_idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m64 * stride_om + n_idx, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_finish_kernel(ws_ptr, res_ptr, out_ptr, M, N_OUT, stride_rm, stride_om,
                         SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    ptrs = ws_ptr + offs_m.to(tl.int64)[None, :] * (N_OUT * (1 + SWIGLU)) + offs_n[:, None]
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # fp32 split-K partials, or the dequant path's y
    acc_up = acc
    if SWIGLU:
        acc_up = tl.load(ptrs + N_OUT, mask=mask, other=0.0).to(tl.float32)
    finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


def kernel_tensors(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes, scales, row_scale)`` as the kernels take them: fp8 codes and scales as bytes, bitcast in
    the kernel (portable loads and masks); per-row scales (fp8 rows, nvfp4 global scale) or None."""
    q = w.tensors["qweight"]
    scales = w.tensors["scales"]
    q = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    scales = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    row_scale = {"fp8": scales, "nvfp4": w.tensors.get("global_scale")}.get(w.format.name)
    return q, scales, row_scale
