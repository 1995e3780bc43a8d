"""The MoE block after its router in one launch, at decode: top-k, the routed and shared experts' gate/up, their
down projections, the combine and the next norm.

At batch 1 a 35B-A3B MoE block is a chain of small launches: the router GEMV, the top-k, the routed experts' gate/up
GEMV, their down GEMV and the combine on the critical path, the shared expert's two GEMMs beside them on a second
stream. Each moves a few MB in 3-9 µs of latency (run 2026-12-05.20, H100: ~27 µs a block against ~4 µs of bytes).
Here one launch does all but the router, in two kinds of work items that its programs take in order from a ticket
counter (an atomic add at their start):

* **A items** (gate/up): ``(token, slot, column tile)`` of a routed expert, then ``(token, column tile)`` of the shared
  expert. Each computes its token's top-k itself (the router kernel's arithmetic: :func:`.routing.top_k_of_row`), the
  SwiGLU of its gate and up rows against the token's row, stores it to a scratch row, and counts itself in at the
  token's counter (release).
* **B items** (down + combine): ``(token, column tile)`` of the output. Each routes its token, requests every routed
  expert's (and the shared expert's) down rows for its columns, then waits until its token's A items have all counted
  in (acquire; a spin on the counter), sums the routing-weighted products, adds ``sigmoid(shared logit)`` times the
  shared expert's, and applies the combine's epilogue: the residual and, by the token's last B item to arrive, its
  RMSNorm (:func:`.down_combine.finish_token_tile`).

No program waits for work that no running program holds: the tickets are handed out in the order programs start, and
every A ticket comes before every B ticket, so an A item a B item waits for belongs to a program that already runs
(the decoupled look-back of CUB's scans rests on the same argument). The Triton interpreter runs programs one after
another: the A items are all done before the first B item starts.

The shared expert's weights are read in their row-major layout (:meth:`QuantizedTensor.row_major`; the caller keeps
the copy). ``NINFER_MOE_FUSED_DECODE=1`` takes this path; configs are timed per shape and token bucket (table
``"moe_fused_decode"``). Off by default because it is slower: the block's time at batch 1 is its chain of dependent
memory latencies, which one launch walks as slowly as five, and at 8 tokens it reads an expert per (token, slot)
(docs/performance.md, "The launch diet's switches measured").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import autotune_configs, env_switch, use_triton
from ninfer.kernels.moe.down_combine import finish_token_tile, request_slabs, slabs_dot_row
from ninfer.kernels.moe.dispatch import moe_experts_reference
from ninfer.kernels.moe.routing import route_topk_reference, top_k_of_row
from ninfer.kernels.norms import NextNorm, rms_norm_reference
from ninfer.kernels.pdl import pdl_enter, small_kernel_pdl
from ninfer.kernels.quant_gemm.common import FMT_CODES, kernel_tensors
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.timing import time_candidates
from ninfer.kernels.quant_gemm.tune import GROUPS, GemmConfig, kernel_params, m_bucket
from ninfer.kernels.quant_gemm.weights import ROWS, QuantizedTensor
from ninfer.kernels.tuning import default_tuner

TABLE = "moe_fused_decode"
MAX_TOKENS = 8
# Counters the launch uses (int32, one bank of ninfer.kernels.counters): the ticket, the programs finished, then one
# A-item counter per token and one B-item counter per token.
_TICKET, _FINISHED, _PER_TOKEN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def fused_decode_enabled() -> bool:
    """``NINFER_MOE_FUSED_DECODE`` (read per call; off by default)."""
    return env_switch("NINFER_MOE_FUSED_DECODE", False)


def _grouped(w: object, stack: bool) -> bool:
    """A row-major quantized weight with group scales (not fp8's per-row ones, whose step-wide groups the gate/up and
    the down steps would not share)."""
    return (isinstance(w, QuantizedTensor) and w.format.name in GROUPS and len(w.shape) == (3 if stack else 2)
            and w.layout == ROWS)


def fused_decode_applies(x: object, gate_up: object, down: object) -> bool:
    """Whether :func:`moe_block_fused_then_norm` takes a call's rows and routed stacks: the switch on, plain float rows
    of at most ``MAX_TOKENS`` tokens on a Triton device, row-major stacks quantized in a grouped format of the GEMV
    helpers (the shared expert: :func:`shared_expert_fits`)."""
    if not fused_decode_enabled() or not isinstance(x, torch.Tensor) or x.dim() != 2:
        return False
    return (use_triton(x) and 0 < x.shape[0] <= MAX_TOKENS and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and x.stride(1) == 1 and _grouped(gate_up, True) and _grouped(down, True))


def shared_expert_fits(gate_up: QuantizedTensor, down: QuantizedTensor) -> bool:
    """Whether the kernel reads these shared-expert weights (2-D, a grouped format) once they are row-major
    (:meth:`QuantizedTensor.row_major`, which the caller makes and keeps)."""
    return all(isinstance(w, QuantizedTensor) and w.format.name in GROUPS and len(w.shape) == 2
               for w in (gate_up, down))


def moe_block_reference(x: torch.Tensor, router_logits: torch.Tensor, shared_logit: torch.Tensor,
                        gate_up: QuantizedTensor, down: QuantizedTensor, shared_gate_up: QuantizedTensor,
                        shared_down: QuantizedTensor, top_k: int, norm_weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`moe_block_fused_then_norm` computes, in fp32 from the dequantized weights: the top-k routing, the
    routed experts, ``sigmoid(shared_logit)`` times the shared SwiGLU MLP, then the norm after the block
    ``(normed, new_residual)``."""
    xf = x.float()
    weights, ids = route_topk_reference(router_logits, top_k)
    routed = moe_experts_reference(xf, gate_up.dequantize(), down.dequantize(), weights.float(), ids)
    gate, up = F.linear(xf, shared_gate_up.dequantize()).chunk(2, dim=-1)
    shared = F.linear(F.silu(gate) * up, shared_down.dequantize())
    block = routed + torch.sigmoid(shared_logit.float()) * shared
    return rms_norm_reference(block, norm_weight.float(), eps, residual.float() if residual is not None else None)


@dataclass(frozen=True)
class _Weight:
    """A quantized weight as the kernel reads it: codes (int32 words for the word decode), scales, row scales."""

    q: torch.Tensor
    s: torch.Tensor
    rs: torch.Tensor
    fmt: str

    @staticmethod
    def of(w: QuantizedTensor, words: bool) -> _Weight:
        q, s, rs = kernel_tensors(w)
        if words:
            q = q.view(torch.int32)
        return _Weight(q, s, rs if rs is not None else s, w.format.name)

    def strides(self) -> tuple[int, int, int, int, int]:
        """(expert, row) strides of codes and scales, and the row scales' expert stride (0 for a 2-D weight)."""
        three = self.q.dim() == 3
        s_row = self.s.stride(-2) if self.s.dim() == self.q.dim() else 0
        return (self.q.stride(0) if three else 0, self.q.stride(-2), self.s.stride(0) if three else 0, s_row,
                self.rs.stride(0) if three and self.rs.dim() > 1 else 0)

    def constexprs(self, prefix: str, block_k: int) -> dict:
        p = kernel_params(self.fmt, GemmConfig(1, 16, block_k, 1, 4, 1, "gemv"))
        return {f"{prefix}FMT": FMT_CODES[self.fmt], f"{prefix}GROUP": p["group"], f"{prefix}ROW_BLOCK": p["row_block"],
                f"{prefix}ROW_SCALE": self.fmt in ("fp8", "nvfp4")}


@triton.jit
def _scaled_rows(acc, rs_ptr, rows, ROW_SCALE: tl.constexpr):
    if ROW_SCALE:
        acc = acc * tl.load(rs_ptr + rows)
    return acc


@triton.jit
def _swiglu_tile(q_ptr, s_ptr, rs_ptr, x_ptr, t, rows, up, stride_xm, stride_qn, stride_sn, K: tl.constexpr,
                 FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_SCALE: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
    """``silu(W[rows] . x[t]) * (W[rows + up] . x[t])`` in fp32, every step's codes requested first."""
    STEPS: tl.constexpr = (K + BK - 1) // BK
    EVEN_K: tl.constexpr = K % BK == 0
    gate_slabs = request_slabs(q_ptr, s_ptr, rows, K, stride_qn, stride_sn, FMT, GROUP, ROW_BLOCK, BK, STEPS, EVEN_K,
                               WORDS)
    up_slabs = request_slabs(q_ptr, s_ptr, rows + up, K, stride_qn, stride_sn, FMT, GROUP, ROW_BLOCK, BK, STEPS,
                             EVEN_K, WORDS)
    g = slabs_dot_row(gate_slabs[0], gate_slabs[1], x_ptr, t, K, stride_xm, FMT, GROUP, BN, BK, STEPS, EVEN_K, WORDS)
    u = slabs_dot_row(up_slabs[0], up_slabs[1], x_ptr, t, K, stride_xm, FMT, GROUP, BN, BK, STEPS, EVEN_K, WORDS)
    g = _scaled_rows(g, rs_ptr, rows, ROW_SCALE)
    u = _scaled_rows(u, rs_ptr, rows + up, ROW_SCALE)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _pick(values, slots, j):
    """Element ``j`` of a small vector."""
    return tl.sum(tl.where(slots == j, values, 0), axis=0)


@triton.jit(do_not_specialize=["T"])
def _moe_fused_kernel(
    x_ptr, logits_ptr, slogit_ptr, gq, gs, grs, dq, ds, drs, sgq, sgs, sgrs, sdq, sds, sdrs, inter_ptr, sinter_ptr,
    res_ptr, norm_w_ptr, out_ptr, new_res_ptr, cnt_ptr,
    T, E, stride_xm, stride_l, stride_sl, g_qe, g_qn, g_se, g_sn, g_re, d_qe, d_qn, d_se, d_sn, d_re,
    sg_qn, sg_sn, sd_qn, sd_sn, eps,
    H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr, K_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_SCALE: tl.constexpr,
    SFMT: tl.constexpr, SGROUP: tl.constexpr, SROW_BLOCK: tl.constexpr, SROW_SCALE: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, BN_A: tl.constexpr, BN_S: tl.constexpr, BN_B: tl.constexpr,
    BK_A: tl.constexpr, BK_B: tl.constexpr, BLOCK_H: tl.constexpr, WORDS: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    TILES_A: tl.constexpr = I // BN_A
    TILES_S: tl.constexpr = IS // BN_S
    TILES_B: tl.constexpr = (H + BN_B - 1) // BN_B
    A_PER_TOKEN: tl.constexpr = TOPK * TILES_A + TILES_S
    item = tl.atomic_add(cnt_ptr + _TICKET, 1, sem="relaxed")
    done = cnt_ptr + _PER_TOKEN  # [T]: A items counted in; [T, 2T): B items arrived
    routed_items = T * TOPK * TILES_A
    slots = tl.arange(0, K_BLOCK)
    dtype = out_ptr.dtype.element_ty
    if item < routed_items:  # A: a routed expert's gate/up tile
        t = item // (TOPK * TILES_A)
        j = (item // TILES_A) % TOPK
        rows_a = (item % TILES_A) * BN_A + tl.arange(0, BN_A)
        _, ids = top_k_of_row(logits_ptr, t, E, stride_l, TOPK, K_BLOCK, E_BLOCK)
        e64 = _pick(ids, slots, j).to(tl.int64)
        y_a = _swiglu_tile(gq + e64 * g_qe, gs + e64 * g_se, grs + e64 * g_re, x_ptr, t, rows_a, I, stride_xm, g_qn,
                           g_sn, H, FMT, GROUP, ROW_BLOCK, ROW_SCALE, BN_A, BK_A, WORDS)
        tl.store(inter_ptr + (t * TOPK + j) * I + rows_a, y_a.to(dtype))
        tl.debug_barrier()
        tl.atomic_add(done + t, 1, sem="release")
    elif item < routed_items + T * TILES_S:  # A: a shared expert's gate/up tile
        t = (item - routed_items) // TILES_S
        rows_s = ((item - routed_items) % TILES_S) * BN_S + tl.arange(0, BN_S)
        y_s = _swiglu_tile(sgq, sgs, sgrs, x_ptr, t, rows_s, IS, stride_xm, sg_qn, sg_sn, H, SFMT, SGROUP, SROW_BLOCK,
                           SROW_SCALE, BN_S, BK_A, False)
        tl.store(sinter_ptr + t * IS + rows_s, y_s.to(dtype))
        tl.debug_barrier()
        tl.atomic_add(done + t, 1, sem="release")
    else:  # B: down projections and the combine of an output tile
        b = item - routed_items - T * TILES_S
        t = b // TILES_B
        offs_n = (b % TILES_B) * BN_B + tl.arange(0, BN_B)
        n_ok = offs_n < H
        rows_b = tl.minimum(offs_n, H - 1)
        weights, ids = top_k_of_row(logits_ptr, t, E, stride_l, TOPK, K_BLOCK, E_BLOCK)
        STEPS: tl.constexpr = (I + BK_B - 1) // BK_B
        SSTEPS: tl.constexpr = (IS + BK_B - 1) // BK_B
        slabs = ()
        for j in tl.static_range(TOPK):  # every down slab requested before the wait
            e64 = _pick(ids, slots, j).to(tl.int64)
            slabs = slabs + (request_slabs(dq + e64 * d_qe, ds + e64 * d_se, rows_b, I, d_qn, d_sn, FMT, GROUP,
                                           ROW_BLOCK, BK_B, STEPS, I % BK_B == 0, WORDS),)
        shared_slab = request_slabs(sdq, sds, rows_b, IS, sd_qn, sd_sn, SFMT, SGROUP, SROW_BLOCK, BK_B, SSTEPS,
                                    IS % BK_B == 0, False)
        # Triton lowers an atomic add of 0 whose value is used to an acquire load (ld.global.gpu.acquire, not an
        # atomic; an unused one it drops): each poll reads L2, and the last one orders the reads of the A items' rows
        # (released at the counter) after their stores.
        arrived = tl.atomic_add(done + t, 0, sem="acquire")
        while arrived < A_PER_TOKEN:
            arrived = tl.atomic_add(done + t, 0, sem="acquire")
        tl.debug_barrier()
        y = tl.zeros((BN_B,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            part = slabs_dot_row(slabs[j][0], slabs[j][1], inter_ptr, t * TOPK + j, I, I, FMT, GROUP, BN_B, BK_B,
                                 STEPS, I % BK_B == 0, WORDS, True)
            part = _scaled_rows(part, drs + _pick(ids, slots, j).to(tl.int64) * d_re, rows_b, ROW_SCALE)
            w = _pick(weights, slots, j).to(logits_ptr.dtype.element_ty).to(tl.float32)  # as the router stores it
            y += (part * w).to(dtype).to(tl.float32)
        shared = slabs_dot_row(shared_slab[0], shared_slab[1], sinter_ptr, t, IS, IS, SFMT, SGROUP, BN_B, BK_B,
                               SSTEPS, IS % BK_B == 0, False, True)
        shared = _scaled_rows(shared, sdrs, rows_b, SROW_SCALE).to(dtype).to(tl.float32)  # the MLP's output
        y += tl.sigmoid(tl.load(slogit_ptr + t * stride_sl).to(tl.float32)) * shared
        last = finish_token_tile(y, t, offs_n, n_ok, res_ptr, norm_w_ptr, out_ptr, new_res_ptr, done + T + t, TILES_B,
                                 H, eps, NORM, RESIDUAL, True, BLOCK_H)
        if last:  # every B item of the token is past its wait: the token's A counter may start again from zero
            tl.store(done + t, 0)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + _FINISHED, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(cnt_ptr + _TICKET, 0)  # every program has taken its ticket
        tl.store(cnt_ptr + _FINISHED, 0)


@dataclass(frozen=True)
class FusedConfig:
    """Columns per routed and per shared A item (gate/up rows of each half) and per B item (output columns), K per
    step of the gate/up and of the down projections, warps, and the int4 routed stacks' 32-bit-word decode."""

    bn_a: int
    bn_s: int
    bn_b: int
    bk_a: int
    bk_b: int
    num_warps: int
    words: bool = False


def fused_candidates(fmt: str, shared_fmt: str, inter: int, shared_inter: int) -> list[FusedConfig]:
    """16-column items by default (the 35B-A3B's 128 routed gate/up items of 16 KB, 128 output tiles a token), shared
    items as many bytes as routed ones where the shared expert has twice the bits (int8 beside int4: 8 columns, 64
    items), the down projection's whole K in one step; narrower gate/up items, wider output tiles and the word decode
    after. Compiled for sm_90 / sm_120 at the 35B-A3B shape (``perf/ptx_moe_decode.py``): 128-168 registers a thread
    for the int4 stacks, no spills; 1024-column gate/up steps, since 256 spilled and 512 took 241 registers at four
    warps."""
    group = max(GROUPS.get(fmt, 1), GROUPS.get(shared_fmt, 1))
    bk_a = max(group, 1024)
    bk_b = max(group, min(triton.next_power_of_2(min(inter, shared_inter)), 512))
    bn_s = 8 if _bits(shared_fmt) > _bits(fmt) else 16
    out = [FusedConfig(16, bn_s, 16, bk_a, bk_b, 4), FusedConfig(16, 16, 16, max(group, 512), bk_b, 8),
           FusedConfig(8, 8, 16, max(group, 512), bk_b, 4), FusedConfig(16, bn_s, 32, max(group, 512), bk_b, 8)]
    if fmt.startswith("int4"):
        out.append(FusedConfig(16, bn_s, 16, bk_a, bk_b, 4, words=True))
    return [c for c in out if inter % c.bn_a == 0 and shared_inter % c.bn_s == 0]


def _bits(fmt: str) -> int:
    return 4 if fmt.startswith("int4") or fmt == "nvfp4" else 8


def launch_fused(x: torch.Tensor, router_logits: torch.Tensor, shared_logit: torch.Tensor, gate_up: QuantizedTensor,
                 down: QuantizedTensor, shared_gate_up: QuantizedTensor, shared_down: QuantizedTensor, top_k: int,
                 norm: NextNorm | None, out: torch.Tensor, cfg: FusedConfig) -> bool:
    """``out [T, H]``: the MoE block's output of ``x [T, H]`` routed by ``router_logits [T, E]`` (top ``top_k``) over
    the stacks ``gate_up [E, 2I, H]`` / ``down [E, H, I]``, plus ``sigmoid(shared_logit [T, 1])`` times the shared
    expert (``shared_gate_up [2 Is, H]``, ``shared_down [H, Is]``, row-major); with ``norm``, ``norm.new_residual``
    receives that plus ``norm.residual`` and ``out`` its RMSNorm. False (nothing launched) where the arrival
    counters are not there (a first use inside graph capture)."""
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter, shared_inter = two_i // 2, shared_gate_up.shape[0] // 2
    if inter % cfg.bn_a or shared_inter % cfg.bn_s or (cfg.words and not gate_up.format.name.startswith("int4")):
        raise ValueError(f"{cfg} does not fit I = {inter}, shared I = {shared_inter}, {gate_up.format.name}")
    if router_logits.stride(1) != 1 or tuple(router_logits.shape) != (t, e) or tuple(shared_logit.shape) != (t, 1):
        raise ValueError(f"router logits {list(router_logits.shape)} / shared logit {list(shared_logit.shape)} "
                         f"do not fit {t} tokens and {e} experts")
    counters = tile_counters(x.device, 2 + 2 * t)
    if counters is None:
        return False
    g, d = _Weight.of(gate_up, cfg.words), _Weight.of(down, cfg.words)
    sg, sd = _Weight.of(shared_gate_up, False), _Weight.of(shared_down, False)
    inter_rows = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    shared_rows = torch.empty(t, shared_inter, dtype=x.dtype, device=x.device)
    items = t * top_k * (inter // cfg.bn_a) + t * (shared_inter // cfg.bn_s) + t * triton.cdiv(h, cfg.bn_b)
    res = norm.residual if norm is not None and norm.residual is not None else out
    pdl = small_kernel_pdl(x.device)
    _moe_fused_kernel[(items,)](
        x, router_logits, shared_logit, g.q, g.s, g.rs, d.q, d.s, d.rs, sg.q, sg.s, sg.rs, sd.q, sd.s, sd.rs,
        inter_rows, shared_rows, res, norm.weight if norm is not None else out, out,
        norm.new_residual if norm is not None else out, counters, t, e, x.stride(0), router_logits.stride(0),
        shared_logit.stride(0), *g.strides(), *d.strides(), sg.strides()[1], sg.strides()[3], sd.strides()[1],
        sd.strides()[3], norm.eps if norm is not None else 0.0,
        H=h, I=inter, IS=shared_inter, TOPK=top_k, K_BLOCK=triton.next_power_of_2(top_k),
        E_BLOCK=triton.next_power_of_2(e), **g.constexprs("", cfg.bk_a), **sg.constexprs("S", cfg.bk_a),
        NORM=norm is not None, RESIDUAL=norm is not None and norm.residual is not None, BN_A=cfg.bn_a, BN_S=cfg.bn_s,
        BN_B=cfg.bn_b,
        BK_A=cfg.bk_a, BK_B=cfg.bk_b, BLOCK_H=triton.next_power_of_2(h), WORDS=cfg.words, **pdl.constexprs(),
        **pdl.options(), num_warps=cfg.num_warps, num_stages=1,
    )
    return True


def moe_block_fused_then_norm(x: torch.Tensor, router_logits: torch.Tensor, shared_logit: torch.Tensor,
                              gate_up: QuantizedTensor, down: QuantizedTensor, shared_gate_up: QuantizedTensor,
                              shared_down: QuantizedTensor, top_k: int, norm_weight: torch.Tensor, eps: float,
                              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MoE block through the norm after it, ``(normed, new_residual)``, in one launch after the router (where
    :func:`fused_decode_applies`; the shared expert's weights row-major), by the config the tuner keeps for the shape
    and token bucket; None where nothing was launched (the caller takes the composed path)."""
    if (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())) or not (
            _grouped(shared_gate_up, False) and _grouped(shared_down, False)):
        return None
    norm = NextNorm(norm_weight.contiguous(), eps, residual, torch.empty(x.shape, dtype=x.dtype, device=x.device))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    fmt, shared_fmt = gate_up.format.name, shared_gate_up.format.name
    e, two_i, h = gate_up.shape
    key = (fmt, shared_fmt, x.dtype, m_bucket(x.shape[0]), h, two_i // 2, shared_gate_up.shape[0] // 2, e, top_k,
           x.device)
    cands = lambda: autotune_configs(fused_candidates(fmt, shared_fmt, two_i // 2, shared_gate_up.shape[0] // 2))  # noqa: E731

    def time_fn(cfgs: list[FusedConfig]) -> dict[FusedConfig, float]:
        trial = NextNorm(norm.weight, eps, residual, torch.empty_like(norm.new_residual))
        sink = torch.empty_like(out)
        return time_candidates(cfgs, lambda cfg: launch_fused(x, router_logits, shared_logit, gate_up, down,
                                                              shared_gate_up, shared_down, top_k, trial, sink, cfg),
                               graphs=True)

    cfg = default_tuner().choose(TABLE, key, cands, time_fn, x.device)
    if not launch_fused(x, router_logits, shared_logit, gate_up, down, shared_gate_up, shared_down, top_k, norm, out,
                        cfg):
        return None
    return out, norm.new_residual
