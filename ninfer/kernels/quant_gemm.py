"""``y = x @ W^T`` with W stored in a quantized format (``ninfer.quant.formats``), dequantized in the K loop.

One kernel family serves every format: each program owns a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T``,
loads a ``[BLOCK_N, BLOCK_K]`` slab of packed weight rows (K contiguous, so whole 16-byte runs per
row), dequantizes it in registers to the activation dtype and feeds it to ``tl.dot`` as the left
operand. Weight rows take the MMA M side, so a decode batch of 1..16 tokens wastes nothing on the
weight side (the dominant traffic) and the dequantized tile never goes back to memory.

* Skinny path (M <= 16, decode): ``BLOCK_M = 16``, narrow weight tiles, optional split-K that
  accumulates fp32 partials with atomics into a zeroed workspace, then a small epilogue kernel.
* GEMV path (M <= 8, ``GemmConfig(kind="gemv")``, :mod:`ninfer.kernels.quant_gemv`): no ``tl.dot``;
  each program dequantizes a wide slab of weight rows in registers and reduces it against each
  token row with ``tl.sum``. The MMA tile pads a 1-token decode to 16 rows and measured 16-47 % of
  copy bandwidth; the GEMV spends nothing on padding. The tuner measures it after the dot
  candidates (never the untuned default); ``_launch`` hands such configs to ``launch_gemv``.
* Tiled path (large M, prefill): ``BLOCK_M`` 32..128 and grouped tile order for L2 reuse of x.
* Dequant path (M > 16, ``GemmConfig(kind="dequant")``, :mod:`ninfer.kernels.quant_dequant`): the
  whole weight is dequantized into a shared workspace in the activation dtype, then cuBLAS multiplies
  (``mm`` / ``addmm`` for the residual, the split-K epilogue kernel below for SwiGLU). The tiled path
  re-dequantizes each weight tile per BLOCK_M rows and measured 0.33-0.5x of cuBLAS at M = 512-4096.
  Offered after the tiled candidates and not for the LM head (workspace size); ``_launch`` hands such
  configs to ``launch_dequant_gemm``, except during CUDA-graph capture (tiled favourite instead).
* Dequantization avoids int->float conversion instructions (bit-pattern tricks, see the helpers):
  at decode the ALU work per weight byte, not the MMA, competes with the memory stream.
* Scales: per-row scales (fp8 rows, nvfp4 global scale) multiply the fp32 accumulator once in the
  epilogue. Group scales multiply each group's ``[BLOCK_N, BLOCK_M]`` partial product on the skinny
  path (exact integer codes go to the MMA) and the dequantized tile on the tiled path (one multiply
  per weight, amortised over BLOCK_M); nvfp4's 16-wide groups always scale the tile.
* Epilogues: ``+ residual``; SwiGLU for a stacked ``[2I, K]`` gate/up weight (gate rows first):
  the program accumulates the gate and the up tile of the same columns and writes ``silu(g) * u``.

Configs come from :mod:`ninfer.kernels.quant_gemm_tune` (benchmarked per GPU, keyed by M bucket, N
and K). The launchers are CUDA-graph safe: no host syncs, the workspace is allocated and zeroed on
the stream. The reference (dequantize in fp32, then matmul) defines correctness and is the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.quant_gemm_tune import (
    FMT_CODES,
    GemmConfig,
    candidates,
    kernel_params,
    select_config,
    sm_count,
)
from ninfer.quant.formats import QuantizedTensor

# Kernel-side format codes (values of quant_gemm_tune.FMT_CODES).
FMT_FP8, FMT_FP8_B128, FMT_INT8, FMT_INT4, FMT_NVFP4 = (tl.constexpr(i) for i in range(5))


@triton.jit
def _int4_values(nib, DTYPE: tl.constexpr):
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
def _e2m1_values(nib):
    """e2m1 nibbles -> fp32 ``value * 2^-126``: sign, exponent and mantissa bits moved to fp32 positions
    form exactly that number (the e2m1 subnormal 0.5 becomes an fp32 subnormal); one multiply-shift
    places all three fields at once, one AND clears the bits in between."""
    bits = (nib.to(tl.uint32) * 0x10400000) & 0x81C00000  # nibble << 28 (sign) plus nibble << 22 (e, m)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scales(s_ptr, rows, k0, K, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
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
def _weight_tile(q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn,
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
            lo, hi = _e2m1_values(lo) * 8.507059173023462e37, _e2m1_values(hi) * 8.507059173023462e37
        elif SCALED:
            lo, hi = _int4_values(lo, tl.float32), _int4_values(hi, tl.float32)
        else:
            lo, hi = _int4_values(lo, DOT_DTYPE), _int4_values(hi, DOT_DTYPE)
        if SCALED:
            scale = _group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, N_GROUPS, EVEN_K)
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
            scale = _group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, N_GROUPS, EVEN_K)
            q = tl.reshape(q.to(tl.float32), (BLOCK_N, N_GROUPS, CHUNK)) * scale[:, :, None]
        w = tl.reshape(q, (BLOCK_N, BLOCK_K))
    return w.to(DOT_DTYPE)


@triton.jit
def _x_tile(x_ptr, xrows, k0, K, stride_xm, WIDTH: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations as ``x^T [WIDTH, BLOCK_M]`` for columns ``[k0, k0 + WIDTH)`` (rows clamped by the caller)."""
    offs_k = k0 + tl.arange(0, WIDTH)
    ptrs = x_ptr + xrows[None, :] * stride_xm + offs_k[:, None]
    return tl.load(ptrs) if EVEN_K else tl.load(ptrs, mask=offs_k[:, None] < K, other=0.0)


@triton.jit
def _k_step(acc, xt, q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn,
            FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
            SCALED: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, EVEN_K: tl.constexpr,
            IEEE: tl.constexpr):
    """``acc += W[rows, k0:k0+WIDTH] @ xt``; unless SCALED the columns form one scale group, applied to
    the ``[BLOCK_N, BLOCK_M]`` product instead of every weight (fewer multiplies when BLOCK_M is small)."""
    w = _weight_tile(q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, SCALED,
                     BLOCK_N, WIDTH, EVEN_K, xt.dtype)
    if SCALED or FMT == FMT_FP8:  # fp8 rows: the row scale multiplies the accumulator at the end
        return _mma(w, xt, acc, IEEE)
    scale = _group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, 1, EVEN_K)
    return acc + _mma(w, xt, tl.zeros(acc.shape, dtype=tl.float32), IEEE) * scale


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 activations: no silent tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om,
            SWIGLU: tl.constexpr, HAS_RES: tl.constexpr):
    """Epilogue on a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` (fp32): SwiGLU, residual add, store."""
    y = acc
    if SWIGLU:
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
    m64 = offs_m.to(tl.int64)[None, :]  # M * N reaches 2^31 for long prompts through the LM head
    if HAS_RES:
        y += tl.load(res_ptr + m64 * stride_rm + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m64 * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _k_loop(acc, acc_up, x_ptr, xrows, q_ptr, s_ptr, rows, first, last, N_OUT, K, stride_xm, stride_qn, stride_sn,
            FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
            SCALED: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SUB: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """K steps ``[first, last)`` of a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T``, SUB columns per dot; with
    SWIGLU the up rows (N_OUT rows further down) accumulate into ``acc_up`` from the same x tile."""
    for step in range(first, last):
        for sub in tl.static_range(BLOCK_K // SUB):
            k0 = step * BLOCK_K + sub * SUB
            xt = _x_tile(x_ptr, xrows, k0, K, stride_xm, SUB, EVEN_K)
            acc = _k_step(acc, xt, q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK,
                          SCALED, BLOCK_N, SUB, EVEN_K, IEEE)
            if SWIGLU:
                acc_up = _k_step(acc_up, xt, q_ptr, s_ptr, rows + N_OUT, k0, K, stride_qn, stride_sn, FMT, GROUP,
                                 CHUNK, ROW_BLOCK, SCALED, BLOCK_N, SUB, EVEN_K, IEEE)
    return acc, acc_up


@triton.jit(do_not_specialize=["M", "steps_per_split"])  # M = 1 and one step per split: no extra compiles
def _quant_gemm_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, res_ptr, out_ptr, ws_ptr,
    M, N_OUT, K, steps_per_split,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
    SCALED: tl.constexpr, ROW_SCALE: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    # Grouped order: GROUP_M row blocks of x sweep all weight tiles together, so x stays in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows load row 0 / N-1 instead of being masked (cheaper); the store drops them.
    xrows = tl.minimum(offs_m, M - 1)
    rows = tl.minimum(offs_n, N_OUT - 1)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    SUB: tl.constexpr = BLOCK_K if SCALED else CHUNK  # columns per dot
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc, acc_up = _k_loop(acc, acc_up, x_ptr, xrows, q_ptr, s_ptr, rows, first, last, N_OUT, K, stride_xm, stride_qn,
                          stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, SCALED, SWIGLU, BLOCK_N, BLOCK_K, SUB, EVEN_K, IEEE)
    n_ok = offs_n < N_OUT
    m_ok = offs_m < M
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if SWIGLU:
            acc_up *= tl.load(rs_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        # Workspace [M, N_OUT * (2 if SWIGLU)]: gate columns first, then up.
        ptrs = ws_ptr + offs_m.to(tl.int64)[None, :] * (N_OUT * (1 + SWIGLU)) + offs_n[:, None]
        tl.atomic_add(ptrs, acc, mask=mask)
        if SWIGLU:
            tl.atomic_add(ptrs + N_OUT, acc_up, mask=mask)
    else:
        _finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


@triton.jit
def _split_finish_kernel(ws_ptr, res_ptr, out_ptr, M, N_OUT, stride_rm, stride_om,
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
    _finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


def quant_matmul_reference(x: torch.Tensor, w: QuantizedTensor, residual: torch.Tensor | None = None,
                           swiglu: bool = False) -> torch.Tensor:
    """``x [..., K] @ dequantize(W)[N, K]^T`` in fp32, then ``silu(gate) * up`` over the two halves of N
    if ``swiglu``, then ``+ residual``; returned in x's dtype."""
    y = x.float() @ w.dequantize(torch.float32).t()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def quant_matmul(x: torch.Tensor, w: QuantizedTensor, residual: torch.Tensor | None = None,
                 swiglu: bool = False) -> torch.Tensor:
    """The quantized linear layer: Triton on CUDA tensors, the reference elsewhere."""
    if w.format.name == "bf16":
        y = F.linear(x, w.tensors["weight"].to(x.dtype))
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y if residual is None else y + residual
    if use_triton(x):
        return quant_matmul_triton(x, w, residual, swiglu)
    return quant_matmul_reference(x, w, residual, swiglu)


def quant_matmul_triton(x: torch.Tensor, w: QuantizedTensor, residual: torch.Tensor | None = None,
                        swiglu: bool = False, *, out: torch.Tensor | None = None,
                        config: GemmConfig | None = None) -> torch.Tensor:
    """Launch the fused dequant-GEMM. ``x [..., K]`` (fp32, fp16 or bf16), W 2-D ``[N, K]``; with
    ``swiglu`` the output has N / 2 columns. ``out`` (contiguous, x's dtype) receives the result if
    given and may be the residual itself (in-place add); ``config`` overrides the tuned choice."""
    if len(w.shape) != 2:
        raise ValueError(f"quant_matmul takes a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K = {k}")
    if swiglu and n % 2:
        raise ValueError(f"swiglu needs a stacked gate/up weight with an even row count, got N = {n}")
    n_out = n // 2 if swiglu else n
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    result = out if out is not None else torch.empty(*lead, n_out, dtype=x.dtype, device=x.device)
    out = result.view(m, n_out)
    if m == 0 or n_out == 0:
        return result
    res = None
    if residual is not None:
        res = residual.reshape(m, n_out)
        if res.stride(-1) != 1:
            res = res.contiguous()

    scratch: list[torch.Tensor] = []

    def trial(cfg: GemmConfig) -> None:  # tuning runs write elsewhere: out may alias the residual
        if not scratch:
            scratch.append(torch.empty_like(out))
        _launch(x2, w, res, scratch[0], swiglu, cfg)

    cfg = config or select_config(w.format.name, x2, n_out, k, swiglu, res is not None, trial)
    _launch(x2, w, res, out, swiglu, cfg)
    return result


def kernel_tensors(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes, scales, row_scale)`` as the kernels take them: fp8 codes and scales as bytes, bitcast in
    the kernel (portable loads and masks); per-row scales (fp8 rows, nvfp4 global scale) or None."""
    q = w.tensors["qweight"]
    scales = w.tensors["scales"]
    q = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    scales = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    row_scale = {"fp8": scales, "nvfp4": w.tensors.get("global_scale")}.get(w.format.name)
    return q, scales, row_scale


def _launch(x: torch.Tensor, w: QuantizedTensor, res: torch.Tensor | None, out: torch.Tensor, swiglu: bool,
            cfg: GemmConfig) -> None:
    m, k = x.shape
    n_out = out.shape[1]
    name = w.format.name
    if cfg.kind == "dequant":  # prefill: dequantize W into a workspace, then cuBLAS (quant_dequant)
        from ninfer.kernels.quant_dequant import launch_dequant_gemm

        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            launch_dequant_gemm(x, w, res, out, swiglu, cfg)
            return
        # A captured graph would keep the shared workspace's address, which a later, larger weight frees
        # (the buffer grows by reallocation): graphs take the tiled favourite instead (compiled already:
        # the tuner ran it when it chose this config).
        cfg = candidates(name, m, n_out, k, sm_count(x.device))[0]
    p = kernel_params(name, cfg)
    q, scales, row_scale = kernel_tensors(w)
    if cfg.kind == "gemv-mma":  # int4 decode on tensor cores (quant_gemv_mma)
        from ninfer.kernels.quant_gemv_mma import launch_gemv_mma

        launch_gemv_mma(x, q, scales, res, out, swiglu, p["group"], cfg)
        return
    if cfg.kind.startswith("gemv"):  # decode GEMV without tl.dot (quant_gemv imports this module's helpers)
        from ninfer.kernels.quant_gemv import launch_gemv

        launch_gemv(x, q, scales, row_scale, res, out, swiglu, FMT_CODES[name], p["group"], p["row_block"], cfg)
        return
    k_steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    split = splits > 1
    ws = torch.zeros(m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) if split else out
    res_arg = res if res is not None else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n), splits)
    _quant_gemm_kernel[grid](
        x, q, scales, row_scale if row_scale is not None else scales, res_arg, out, ws,
        m, n_out, k, per_split,
        x.stride(0), q.stride(-2), scales.stride(-2) if scales.dim() >= 2 else 0, res_arg.stride(0), out.stride(0),
        FMT=FMT_CODES[name], GROUP=p["group"], CHUNK=p["chunk"], ROW_BLOCK=p["row_block"], SCALED=p["scaled"],
        ROW_SCALE=row_scale is not None, SWIGLU=swiglu, HAS_RES=res is not None, SPLIT=split,
        IEEE=x.dtype == torch.float32, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        fin = (triton.cdiv(n_out, 64), triton.cdiv(m, 16))
        _split_finish_kernel[fin](ws, res_arg, out, m, n_out, res_arg.stride(0), out.stride(0),
                                  SWIGLU=swiglu, HAS_RES=res is not None, BLOCK_M=16, BLOCK_N=64, num_warps=4)
