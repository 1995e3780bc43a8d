"""Prefill path for quantized weights: dequantize the whole weight into a workspace, then cuBLAS.

The tiled dequant-in-the-K-loop kernel of :mod:`ninfer.kernels.quant_gemm` measured 0.33-0.5x of
cuBLAS bf16 at M = 512-4096 on an H200 (it dequantizes each weight tile once per BLOCK_M rows of x,
and its ``tl.dot`` pipeline is weaker than cuBLAS's). Writing the dequantized weight once costs one
pass over it (packed bytes in, activation-dtype values out: ~0.1 ms for 34816 x 5120 at 4 TB/s),
after which the GEMM runs at cuBLAS speed. It pays off only where the GEMM is long enough, so it is a
tuner candidate (``GemmConfig(kind="dequant")``, M > 16, after the tiled favourite) chosen only where
it measures faster; untuned keys keep the tiled kernel.

* Dequant kernel: one program per ``[BLOCK_N, BLOCK_K]`` tile of W, decoded by the tiled kernel's
  :func:`ninfer.kernels.quant_gemm.weight_tile` (16-byte loads of packed rows, exact codes in
  fp32), scaled in fp32 in the reference's order and rounded once to the workspace dtype: bit for
  bit what ``QuantizedTensor.dequantize`` gives in that dtype. Rows past N are clamped on load and
  masked on store; a ragged last K tile is masked (EVEN_K otherwise).
* Row scales (fp8 per-row scales, the nvfp4 per-row global scale) are folded into the dequantized
  weight (fp32, before the one rounding) rather than applied to the GEMM output: then the residual
  add can be cuBLAS's own ``beta = 1`` epilogue (``addmm``: fp32 sum, one rounding, in place when
  ``out`` is the residual), with no extra pass over y and no rounding of y before the add.
* SwiGLU (stacked ``[2I, K]`` gate/up weight): cuBLAS writes ``y [M, 2I]`` (gate columns first, in
  the activation dtype, as the bf16 path's ``F.linear`` does; the activation estimate of the memory
  plan covers it), then the split-K epilogue kernel of quant_gemm computes ``silu(g) * u (+ res)``
  in fp32 and writes ``out`` (which may alias the residual: each element is read before written).
* Workspace: one buffer per (device, dtype), from PyTorch's caching allocator, kept in a module dict
  and grown (reallocated) to the largest weight seen, so serving allocates nothing new after the
  first prefill. The tuner offers this path only for weights of at most
  ``tune.DEQUANT_MAX_ELEMENTS`` (512 MiB in bf16; the LM head stays out), and the memory
  plan (:func:`ninfer.runtime.memory.plan_memory`) reserves the largest such weight's bytes.
  CUDA graphs (the prompt-chunk graph) capture this path only where the buffer already holds the weight
  (:func:`graph_workspace_fits`; the warm-up's prefill has grown it to the largest weight by then): the capture
  never grows it, and a buffer a graph captured is kept for the process (``_KEPT``), so that a later growth or
  :func:`release_workspaces` cannot free memory the graph still writes. Elsewhere quant_gemm takes another path
  while capturing (``tune.graph_fallback``).
* No host syncs. The reference is ``QuantizedTensor.dequantize`` (tests compare against it).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import capturing
from ninfer.kernels.quant_gemm.common import (
    FMT_CODES,
    FMT_FP8,
    group_scales,
    kernel_tensors,
    split_finish_kernel,
    weight_tile,
)
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, dequantize_fragments
from ninfer.kernels.quant_gemm.fragments_fp4 import dequantize_fp4_fragments
from ninfer.kernels.quant_gemm.tune import (
    DEQUANT_MAX_ELEMENTS,
    GemmConfig,
    kernel_params,
)
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

DEFAULT_CONFIG = GemmConfig(128, 32, 256, 1, 4, 1, "dequant")
_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []  # buffers CUDA graphs captured: they live as long as the process


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, rs_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                    FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
                    ROW_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The K tiles of a row block are consecutive programs: neighbours read and write adjacent memory.
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    offs_n = (pid // num_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = (pid % num_k) * BLOCK_K
    rows = tl.minimum(offs_n, N - 1)  # weight_tile wants valid rows; the store drops the copies
    # Exact codes / e2m1 values in fp32 (SCALED=False), scaled here in the reference's order: group
    # scale times row scale first, then the code, so that every format matches ``dequantize`` bit for
    # bit (nvfp4's (e2m1 * block) * global, as SCALED=True would give, differs from it by 1 fp32 ulp).
    w = weight_tile(q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, False,
                     BLOCK_N, BLOCK_K, EVEN_K, tl.float32)
    if FMT != FMT_FP8:
        N_GROUPS: tl.constexpr = BLOCK_K // CHUNK
        scale = group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, N_GROUPS, EVEN_K)
        if ROW_SCALE:  # nvfp4's global scale
            scale = scale * tl.load(rs_ptr + rows)[:, None]
        w = tl.reshape(tl.reshape(w, (BLOCK_N, N_GROUPS, CHUNK)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
    elif ROW_SCALE:  # fp8 rows: one scale per row, no groups along K
        w = w * tl.load(rs_ptr + rows)[:, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None]  # constant along K: keeps the 16-byte stores
    if not EVEN_K:
        mask = mask & (offs_k < K)[None, :]
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(w: QuantizedTensor, out: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """Write ``dequantize(W)`` of a 2-D weight ``[N, K]`` into ``out`` (``[N, K]``, unit stride along K,
    any float dtype) and return it. ``config`` gives the tile (``block_n``, ``block_k``, warps, stages)."""
    if len(w.shape) != 2:
        raise ValueError(f"dequantize_triton takes a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if tuple(out.shape) != (n, k) or (k > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{n}, {k}] with unit stride along K; got {list(out.shape)} {out.stride()}")
    if n == 0 or k == 0:
        return out
    cfg = config or DEFAULT_CONFIG
    name = w.format.name
    p = kernel_params(name, cfg)
    q, scales, row_scale = kernel_tensors(w)
    if w.layout == FRAGMENTS:
        if name == "nvfp4":
            return dequantize_fp4_fragments(q, scales, row_scale, out)
        return dequantize_fragments(q, scales, p["group"], out)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k),)
    _dequant_kernel[grid](
        q_ptr=q, s_ptr=scales, rs_ptr=row_scale if row_scale is not None else scales, w_ptr=out, N=n, K=k,
        stride_qn=q.stride(-2), stride_sn=scales.stride(-2) if scales.dim() >= 2 else 0, stride_wn=out.stride(0),
        FMT=FMT_CODES[name], GROUP=p["group"], CHUNK=p["chunk"], ROW_BLOCK=p["row_block"],
        ROW_SCALE=row_scale is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def workspace(n: int, k: int, dtype: torch.dtype, device: torch.device, *, captured: bool = False) -> torch.Tensor:
    """The shared ``[n, k]`` dequantization buffer of (device, dtype), grown to the largest size asked.

    Callers on one stream may reuse it freely (stream order serialises them); its contents last only
    until the next dequantization. ``captured``: for a launch a CUDA graph captures (or will), which must find
    the buffer large enough already (:func:`graph_workspace_fits`) and keeps it alive for the process."""
    key = _key(device, dtype)
    buf = _WORKSPACE.get(key)
    if captured:
        if buf is None or buf.numel() < n * k:
            raise ValueError(f"no dequantization workspace of {n} x {k} to capture: a graph may not grow it")
        if not any(kept is buf for kept in _KEPT):
            _KEPT.append(buf)
        return buf[: n * k].view(n, k)
    if buf is None or buf.numel() < n * k:
        _WORKSPACE.pop(key, None)  # release the smaller buffer first: the allocator may reuse its block
        buf = _WORKSPACE[key] = torch.empty(n * k, dtype=dtype, device=device)
    return buf[: n * k].view(n, k)


def graph_workspace_fits(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a CUDA graph can capture the dequantization of an ``[n, k]`` weight: the buffer of (device,
    dtype) already holds it."""
    buf = _WORKSPACE.get(_key(device, dtype))
    return buf is not None and buf.numel() >= n * k


def _key(device: torch.device | str, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """The buffer's key: "cuda" and "cuda:0" (the current device) are one device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype


def release_workspaces() -> None:
    """Drop the buffers (tests, or a process that stops prefilling); the caching allocator keeps the blocks, and
    buffers a CUDA graph captured stay alive."""
    _WORKSPACE.clear()


def workspace_bytes(shapes: Iterable[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes the workspace reaches for 2-D weights of these ``(N, K)`` shapes: the largest that the tuner
    may send down this path (at most ``DEQUANT_MAX_ELEMENTS``), in ``dtype``."""
    sizes = [s[0] * s[1] for s in shapes if len(s) == 2 and s[0] * s[1] <= DEQUANT_MAX_ELEMENTS]
    return max(sizes, default=0) * dtype.itemsize


def launch_dequant_gemm(x: torch.Tensor, w: QuantizedTensor, res: torch.Tensor | None, out: torch.Tensor,
                        swiglu: bool, cfg: GemmConfig) -> None:
    """``out = epilogue(x [M, K] @ dequantize(W)^T)`` with quant_gemm's epilogues; ``x`` rows of unit
    stride, ``out`` ``[M, N_OUT]`` contiguous, ``res`` (or None) ``[M, N_OUT]``, possibly ``out`` itself."""
    n, k = w.shape
    m, n_out = out.shape
    wd = dequantize_triton(w, workspace(n, k, x.dtype, x.device, captured=capturing(x)), cfg).t()
    if not swiglu:
        if res is None:
            torch.mm(x, wd, out=out)
        elif res.data_ptr() == out.data_ptr():
            out.addmm_(x, wd)  # in place: cuBLAS reads C and writes the sum (beta = 1) in one pass
        else:
            torch.addmm(res, x, wd, out=out)
        return
    y = torch.mm(x, wd)  # [M, 2 * N_OUT]: gate columns, then up
    res_arg = res if res is not None else out
    grid = (triton.cdiv(n_out, 128), triton.cdiv(m, 16))
    split_finish_kernel[grid](
        ws_ptr=y, res_ptr=res_arg, out_ptr=out, M=m, N_OUT=n_out, stride_rm=res_arg.stride(0),
        stride_om=out.stride(0), SWIGLU=True, HAS_RES=res is not None, BLOCK_M=16, BLOCK_N=128, num_warps=4,
    )
