"""Gated DeltaNet decode: the token-by-token rule over a few tokens per sequence (Triton).

One program owns one (sequence, value head, dv block): it keeps its ``[dk, BV]`` slice of the fp32
state in registers for all of the sequence's tokens, so the state is read and written once per
call. Decode is bound by that state traffic (64 KB per head at dk = dv = 128), so dv is split into
blocks to put enough programs on the GPU at batch 1. Gates, q/k L2 norm and the GQA head mapping
are fused; nothing is materialised besides the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.deltanet.common import check_head_dims, decay_beta, l2_normalize
from ninfer.kernels.dispatch import autotune_configs


def fit_block_v(configs: list, named_args: dict, **kwargs: object) -> list:
    """Autotune pruning: drop dv blocks wider than dv (small test shapes; BV = 16 always fits)."""
    dv = kwargs.get("DV", named_args.get("DV"))
    return [c for c in configs if c.kwargs["BV"] <= dv]


@ninfer_autotune(
    configs=autotune_configs([
        triton.Config({"BV": bv}, num_warps=w) for bv in (16, 32, 64) for w in (2, 4, 1)
    ]),
    key=["DK", "DV", "HV", "GROUP", "BATCH_LOG2", "HAS_OUT_SLOTS"],
    prune_configs_by={"early_config_prune": fit_block_v},
    restore_value=["state"],  # the state is updated in place: benchmarking configs must not advance it
)
@triton.jit
def _recurrent_kernel(
    q, k, v, a, b, A_log, dt_bias, state, o, cu_seqlens, slot_ids, out_slots,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    stride_state_s, stride_out_slots_b, scale, BATCH_LOG2,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    HAS_OUT_SLOTS: tl.constexpr,
):
    seq = tl.program_id(0) // HV
    head = tl.program_id(0) % HV
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - bos
    if length <= 0:  # an empty sequence leaves its slot alone, as the reference does
        return
    key_head = head // GROUP
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    head_block = head * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    slot = tl.load(slot_ids + seq).to(tl.int64)
    s = tl.load(state + slot * stride_state_s + head_block)
    neg_A = -tl.exp(tl.load(A_log + head).to(tl.float32))
    bias = tl.load(dt_bias + head).to(tl.float32)
    for t in range(length):
        tok = bos + t
        q_t = l2_normalize(tl.load(q + tok * stride_q_t + key_head * stride_q_h + offs_k), scale, 0)[:, None]
        k_t = l2_normalize(tl.load(k + tok * stride_k_t + key_head * stride_k_h + offs_k), 1.0, 0)[:, None]
        v_t = tl.load(v + tok * stride_v_t + head * stride_v_h + offs_v).to(tl.float32)
        g, beta = decay_beta(tl.load(a + tok * stride_a_t + head), tl.load(b + tok * stride_b_t + head),
                             neg_A, bias)
        s = s * tl.exp(g)
        delta = (v_t - tl.sum(s * k_t, axis=0)) * beta
        s = s + k_t * delta[None, :]
        o_t = tl.sum(s * q_t, axis=0)
        tl.store(o + tok * (HV * DV) + head * DV + offs_v, o_t.to(o.dtype.element_ty))
        if HAS_OUT_SLOTS:
            out_slot = tl.load(out_slots + seq * stride_out_slots_b + t).to(tl.int64)
            tl.store(state + out_slot * stride_state_s + head_block, s)
    if not HAS_OUT_SLOTS:
        tl.store(state + slot * stride_state_s + head_block, s)


def gated_delta_rule_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    state_out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Recurrent gated delta rule for short sequences (decode, speculative verification).

    Same contract as ``gated_delta_rule`` (q, k ``[N, Hk, dk]``, v ``[N, Hv, dv]``, a, b ``[N, Hv]``,
    fp32 state ``[S, Hv, dk, dv]`` at ``slot_ids [B]``). Cost grows with the longest sequence, so use
    it for a few tokens per sequence. With ``state_out_slots [B, max_T]`` (int) the state after token
    ``t`` of sequence ``b`` goes to slot ``state_out_slots[b, t]`` and the input slots are only read.
    """
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = slot_ids.shape[0]
    assert k.shape == q.shape and v.shape[0] == n and hv % hk == 0 and check_head_dims(dk, dv)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert state.dtype == torch.float32 and state.shape[1:] == (hv, dk, dv) and state[0].is_contiguous()
    o = torch.empty((n, hv, dv), dtype=v.dtype, device=v.device)
    has_out = state_out_slots is not None
    out_slots = state_out_slots if has_out else slot_ids
    grid = lambda meta: (batch * hv, dv // meta["BV"])  # noqa: E731
    _recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, o, cu_seqlens, slot_ids, out_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), out_slots.stride(0) if has_out else 0, dk ** -0.5, batch.bit_length(),
        HV=hv, GROUP=hv // hk, DK=dk, DV=dv, HAS_OUT_SLOTS=has_out,
    )
    return o
