"""Gated DeltaNet: the gated delta rule over a ragged batch with fp32 state slots (reference §8).

Per token (all fp32), with ``q, k`` L2-normalised and ``q`` scaled by ``dk ** -0.5``::

    S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q

Value head ``j`` reads key/query head ``j // (Hv / Hk)``. Multi-token calls use the chunked
(WY/UT) form with chunks of 64, single tokens the recurrent form; both compute the same function.
"""
from __future__ import annotations

import torch

from ninfer.kernels.deltanet.chunk import gated_delta_rule_chunked_triton
from ninfer.kernels.deltanet.recurrent import gated_delta_rule_recurrent_triton
from ninfer.kernels.deltanet.reference import gated_delta_rule_reference
from ninfer.kernels.dispatch import use_triton

# Longest sequence for which the recurrent kernel runs (decode, speculative verification): its cost
# per token is a full pass over the state slice, while the chunked kernels pay fixed per-chunk work.
RECURRENT_MAX_SEQLEN = 8


def gated_delta_rule(
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
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
    ckpt_offsets: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`gated_delta_rule_reference`; Triton on CUDA (recurrent when ``max_seqlen`` is small or
    per-token states are asked for; checkpoints take the chunked kernel, which writes them in-launch)."""
    if use_triton(v):
        args = (q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, slot_ids)
        if ckpt_offsets is not None:
            assert state_out_slots is None, "per-token states and checkpoints are not asked for together"
            return gated_delta_rule_chunked_triton(*args, ckpt_offsets=ckpt_offsets, ckpt_slots=ckpt_slots)
        if state_out_slots is not None or (max_seqlen is not None and max_seqlen <= RECURRENT_MAX_SEQLEN):
            return gated_delta_rule_recurrent_triton(*args, state_out_slots=state_out_slots)
        return gated_delta_rule_chunked_triton(*args)
    return gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, slot_ids, max_seqlen,
                                      state_out_slots, ckpt_offsets, ckpt_slots)
