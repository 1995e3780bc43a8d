"""``y = x @ W^T`` with W stored in a quantized format (``ninfer.quant.formats``), dequantized in the K loop.

One kernel family serves every format: each program owns a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T``,
loads a ``[BLOCK_N, BLOCK_K]`` slab of packed weight rows (K contiguous, so whole 16-byte runs per
row), dequantizes it in registers to the activation dtype and feeds it to ``tl.dot`` as the left
operand. Weight rows take the MMA M side, so a decode batch of 1..16 tokens wastes nothing on the
weight side (the dominant traffic) and the dequantized tile never goes back to memory.

* Skinny path (M <= 16, decode): ``BLOCK_M = 16``, narrow weight tiles, optional split-K that
  accumulates fp32 partials with atomics into a zeroed workspace, then a small epilogue kernel.
* GEMV path (M <= 8, ``GemmConfig(kind="gemv")``, :mod:`ninfer.kernels.quant_gemm.gemv`): no ``tl.dot``;
  each program dequantizes a wide slab of weight rows in registers and reduces it against each
  token row with ``tl.sum``. The MMA tile pads a 1-token decode to 16 rows and measured 16-47 % of
  copy bandwidth; the GEMV spends nothing on padding. The tuner measures it after the dot
  candidates (never the untuned default); ``_launch`` hands such configs to ``launch_gemv``.
* Tiled path (large M, prefill): ``BLOCK_M`` 32..128 and grouped tile order for L2 reuse of x.
* Dequant path (M > 16, ``GemmConfig(kind="dequant")``, :mod:`ninfer.kernels.quant_gemm.dequant`): the
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
* int4 and int8-g64 weights in the fragment layout (``QuantizedTensor.layout``, :mod:`ninfer.kernels.quant_gemm.fragments`,
  re-laid once at load time on CUDA) take the register decode of :mod:`ninfer.kernels.quant_gemm.fragment_mma`
  (``GemmConfig(kind="frag")``) up to 32 tokens; prefill sizes take the dequant path, beside the decode's
  favourite up to 512 tokens (the tuner picks by measurement; ``tune.fragment_layout_candidates``); inside CUDA
  graphs of prompt chunks, where the dequant path is unavailable, and for weights too large for its workspace,
  the tiled ``tl.dot`` GEMM of :mod:`ninfer.kernels.quant_gemm.fragment_tiled` (``kind="frag-tiled"``) joins the
  decodes (``tune.graph_candidates``); the other kernels read the row-major layout only.

Configs come from :mod:`ninfer.kernels.quant_gemm.tune` (benchmarked per GPU, keyed by M bucket, N
and K). The launchers are CUDA-graph safe: no host syncs, the workspace is allocated and zeroed on
the stream. The reference (dequantize in fp32, then matmul) defines correctness and is the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from ninfer.kernels.dispatch import capturing, deferred_norm, norm_in_gemm, use_triton
from ninfer.kernels.norms import NextNorm, NormedRows, rms_norm
from ninfer.kernels.quant_gemm.common import (
    FMT_CODES,
    kernel_tensors,
    split_finish_kernel,
)
from ninfer.kernels.quant_gemm.configs import REGISTER_KINDS
from ninfer.kernels.quant_gemm.deferred_norm import MAX_ROWS as DEFER_MAX_ROWS
from ninfer.kernels.quant_gemm.dequant import graph_workspace_fits, launch_dequant_gemm
from ninfer.kernels.quant_gemm.fragment_mma import (
    fragment_tile_groups,
    launch_fragment_mma,
)
from ninfer.kernels.quant_gemm.fragment_tiled import launch_fragment_tiled
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.kernels.quant_gemm.gemm import quant_gemm_kernel
from ninfer.kernels.quant_gemm.gemv import launch_gemv, tile_counters
from ninfer.kernels.quant_gemm.gemv_mma import launch_gemv_mma
from ninfer.kernels.quant_gemm.norm_epilogue import MAX_ROWS
from ninfer.kernels.quant_gemm.tune import (
    GemmConfig,
    graph_fallback,
    kernel_params,
    select_config,
    sm_count,
)
from ninfer.kernels.quant_gemm.weights import QuantizedTensor


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


def quant_matmul(x: torch.Tensor | NormedRows, w: QuantizedTensor, residual: torch.Tensor | None = None,
                 swiglu: bool = False) -> torch.Tensor:
    """The quantized linear layer: Triton on CUDA tensors, the reference elsewhere. Rows whose norm was deferred
    (:class:`~ninfer.kernels.norms.NormedRows`) go to the register decode, which normalizes them, where it runs,
    and are materialized for every other path."""
    if isinstance(x, NormedRows):
        if use_triton(x.scaled) and w.layout == FRAGMENTS and x.scaled.dim() == 2:
            return quant_matmul_triton(x.scaled, w, residual, swiglu, row_norm=x)
        x = x.materialize()
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
                        config: GemmConfig | None = None, row_norm: NormedRows | None = None) -> torch.Tensor:
    """Launch the fused dequant-GEMM. ``x [..., K]`` (fp32, fp16 or bf16), W 2-D ``[N, K]``; with
    ``swiglu`` the output has N / 2 columns. ``out`` (contiguous, x's dtype) receives the result if
    given and may be the residual itself (in-place add); ``config`` overrides the tuned choice. ``row_norm``:
    ``x`` is its ``scaled`` rows, normalized by the register decode (a config of another kind reads
    ``row_norm.materialize()`` instead)."""
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

    cfg = config or _tuned(x2, w, res, out, swiglu)
    if w.layout == FRAGMENTS and not (cfg.kind == "dequant" or cfg.kind.startswith("frag")):
        raise ValueError(f"a weight in the fragment layout takes frag, frag-tiled(-codes) or dequant configs, "
                         f"not {cfg.kind!r}")
    if row_norm is not None:
        if cfg.kind in REGISTER_KINDS:
            row_norm = row_norm.over(x2)
        else:
            x2, row_norm = row_norm.materialize().reshape(m, k), None
    _launch(x2, w, res, out, swiglu, cfg, row_norm)
    return result


def quant_matmul_then_norm(x: torch.Tensor, w: QuantizedTensor, norm_weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None, *, config: GemmConfig | None = None,
                           defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
    """``rms_norm(quant_matmul(x, W), norm_weight, eps, residual)``: ``(normed, new residual stream)``. Up to
    ``MAX_ROWS`` tokens of a weight that the register decode reads (:mod:`.norm_epilogue`), unless
    ``NINFER_NORM_IN_GEMM=0``, the GEMM's launch applies the norm; otherwise the norm is its own launch. With
    ``defer`` (the caller's readers take :class:`~ninfer.kernels.norms.NormedRows`) unless ``NINFER_DEFERRED_NORM=0``,
    a register decode of up to ``DEFER_MAX_ROWS`` tokens returns the normed rows deferred (:mod:`.deferred_norm`).
    ``config`` overrides the tuned choice."""
    deferred = defer and deferred_norm()
    if (deferred or norm_in_gemm()) and (got := _norm_in_gemm(x, w, norm_weight, eps, residual, config, deferred)):
        return got
    y = quant_matmul_triton(x, w, config=config) if config is not None and use_triton(x) else quant_matmul(x, w)
    return rms_norm(y, norm_weight, eps, residual)


def _norm_in_gemm(x: torch.Tensor, w: QuantizedTensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, config: GemmConfig | None,
                  deferred: bool) -> tuple[torch.Tensor | NormedRows, torch.Tensor] | None:
    """:func:`quant_matmul_then_norm` through the register decode: the norm applied by its last program
    (:mod:`.norm_epilogue`) or, ``deferred``, left to the readers (:mod:`.deferred_norm`); None where it does not
    run."""
    rows = DEFER_MAX_ROWS if deferred else MAX_ROWS
    if not (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= rows and w.layout == FRAGMENTS):
        return None
    n, k = w.shape
    m = x.shape[0]
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    new_res = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = config or _tuned(x2, w, None, new_res, False)
    if cfg.kind not in REGISTER_KINDS or (not deferred and tile_counters(x.device, 1) is None):
        return None
    if deferred:
        normed = NormedRows(torch.empty_like(new_res),
                            torch.empty(fragment_tile_groups(n, cfg), m, dtype=torch.float32, device=x.device), eps)
    else:
        normed = torch.empty_like(new_res)
    q, scales, row_scale = kernel_tensors(w)
    group = kernel_params(w.format.name, cfg)["group"]
    launch_fragment_mma(x2, q, scales, None, normed.scaled if deferred else normed, False, group, cfg,
                        row_scale if w.format.name == "nvfp4" else None,
                        norm=NextNorm(norm_weight.contiguous(), eps, res, new_res),
                        deferred=normed if deferred else None)
    return normed, new_res


def _tuned(x: torch.Tensor, w: QuantizedTensor, res: torch.Tensor | None, out: torch.Tensor,
           swiglu: bool) -> GemmConfig:
    """The tuned config of this GEMM (timed on first use of its key: the trials write a scratch, since ``out`` may
    alias the residual)."""
    scratch: list[torch.Tensor] = []

    def trial(cfg: GemmConfig) -> None:
        if not scratch:
            scratch.append(torch.empty_like(out))
        _launch(x, w, res, scratch[0], swiglu, cfg)

    n, k = w.shape
    graph = capturing(x)
    return select_config(w.format.name, x, out.shape[1], k, swiglu, res is not None, trial, w.layout, graph=graph,
                         dequant_in_graph=graph and graph_workspace_fits(n, k, x.dtype, x.device))


def _launch(x: torch.Tensor, w: QuantizedTensor, res: torch.Tensor | None, out: torch.Tensor, swiglu: bool,
            cfg: GemmConfig, row_norm: NormedRows | None = None) -> None:
    m, k = x.shape
    n_out = out.shape[1]
    name = w.format.name
    if cfg.kind == "dequant":  # prefill: dequantize W into a workspace, then cuBLAS (dequant)
        if not capturing(x) or graph_workspace_fits(*w.shape, x.dtype, x.device):
            launch_dequant_gemm(x, w, res, out, swiglu, cfg)
            return
        # A capture may not grow the shared workspace (a graph keeps its address): without a buffer that holds
        # the weight, graphs take another path (graph_fallback). Tuned calls only get here if the buffer was
        # released between a graph-bound tuning pass and its capture; otherwise an explicit config does.
        cfg = graph_fallback(name, m, n_out, k, sm_count(x.device), w.layout)
    p = kernel_params(name, cfg)
    q, scales, row_scale = kernel_tensors(w)
    if cfg.kind in REGISTER_KINDS:  # int4 / int8 / nvfp4 in the fragment layout, from registers (fragment_mma)
        launch_fragment_mma(x, q, scales, res, out, swiglu, p["group"], cfg, row_scale if name == "nvfp4" else None,
                            row_norm=row_norm)
        return
    if cfg.kind.startswith("frag-tiled"):  # the same layout at prefill sizes, on tensor cores by tl.dot (fragment_tiled)
        if name == "nvfp4":
            raise ValueError("the tiled GEMM over the fragment layout reads int4 and int8 codes, not nvfp4")
        launch_fragment_tiled(x, q, scales, res, out, swiglu, p["group"], cfg)
        return
    if cfg.kind == "gemv-mma":  # int4 decode on tensor cores (gemv_mma)
        launch_gemv_mma(x, q, scales, res, out, swiglu, p["group"], cfg)
        return
    if cfg.kind.startswith("gemv"):  # decode GEMV without tl.dot (gemv)
        launch_gemv(x, q, scales, row_scale, res, out, swiglu, FMT_CODES[name], p["group"], p["row_block"], cfg)
        return
    k_steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    split = splits > 1
    ws = torch.zeros(m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) if split else out
    res_arg = res if res is not None else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n), splits)
    quant_gemm_kernel[grid](
        x_ptr=x, q_ptr=q, s_ptr=scales, rs_ptr=row_scale if row_scale is not None else scales, res_ptr=res_arg,
        out_ptr=out, ws_ptr=ws, M=m, N_OUT=n_out, K=k, steps_per_split=per_split, stride_xm=x.stride(0),
        stride_qn=q.stride(-2), stride_sn=scales.stride(-2) if scales.dim() >= 2 else 0,
        stride_rm=res_arg.stride(0), stride_om=out.stride(0), FMT=FMT_CODES[name], GROUP=p["group"],
        CHUNK=p["chunk"], ROW_BLOCK=p["row_block"], SCALED=p["scaled"], ROW_SCALE=row_scale is not None,
        SWIGLU=swiglu, HAS_RES=res is not None, SPLIT=split, IEEE=x.dtype == torch.float32,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        fin = (triton.cdiv(n_out, 64), triton.cdiv(m, 16))
        split_finish_kernel[fin](
            ws_ptr=ws, res_ptr=res_arg, out_ptr=out, M=m, N_OUT=n_out, stride_rm=res_arg.stride(0),
            stride_om=out.stride(0), SWIGLU=swiglu, HAS_RES=res is not None, BLOCK_M=16, BLOCK_N=64, num_warps=4,
        )
