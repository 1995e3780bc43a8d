"""The Gated DeltaNet token mixer after its input projections: causal conv + SiLU, the gated delta rule and
the gated RMSNorm, as one op (reference §8).

``qkv [N, 2 Hk dk + Hv dv]`` are the pre-conv channels (q, k, v, each head-major), ``z [N, Hv dv]`` the
output gate, ``a, b [N, Hv]`` the raw decay and beta projections (all may be row-strided views of the
projections' outputs). At decode on CUDA one kernel (:mod:`.decode`) does it all, the a/b projection included
when it comes as a :class:`GateProjection` with a float weight; elsewhere (prefill, prefix-cache checkpoints,
CPU) the three ops run one after another, each through its own dispatcher.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.kernels.conv import causal_conv1d, causal_conv1d_reference
from ninfer.kernels.deltanet.common import check_head_dims
from ninfer.kernels.deltanet.decode import MAX_TOKENS, TL_DTYPE, gated_deltanet_decode_triton
from ninfer.kernels.deltanet.dispatch import RECURRENT_MAX_SEQLEN, gated_delta_rule
from ninfer.kernels.deltanet.reference import gated_delta_rule_reference
from ninfer.kernels.dispatch import env_switch, use_triton
from ninfer.kernels.norms import NormedRows, gated_rms_norm, gated_rms_norm_reference
from ninfer.kernels.overlap import Overlapped, overlapped, wait_for


@dataclass(frozen=True)
class GateProjection:
    """The a/b gates as a projection of ``x [N, H]``: ``project(x) [N, 2 Hv]`` (a columns, then b). Where the
    one-launch decode runs and ``weight`` (float ``[2 Hv, H]``, the projection's) is given, the kernel applies it
    itself: no GEMM launch for two columns per head. Every other path calls ``project``."""

    x: torch.Tensor | NormedRows  # rows whose norm was deferred: the projection normalizes them
    project: Callable[[torch.Tensor], torch.Tensor]
    weight: torch.Tensor | None = None

    def gates(self, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.project(self.x).split(hv, dim=-1)  # column views: the kernels take row strides
        return a, b

    def started(self, hv: int) -> Gates:
        """The gates as :func:`gated_deltanet` will take them: this projection where the decode kernel applies it
        itself, else its GEMM launched now, on a second stream in a captured decode step
        (:func:`~ninfer.kernels.overlap.overlapped`), so that it runs beside the launches that follow."""
        if gates_in_kernel(self):
            return self
        return overlapped(lambda: self.gates(hv), self.x)


# (a, b), what computes them, or their GEMM's results on another stream
Gates = tuple[torch.Tensor, torch.Tensor] | GateProjection | Overlapped[tuple[torch.Tensor, torch.Tensor]]


def _gate_values(gates: Gates, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gates.gates(hv) if isinstance(gates, GateProjection) else wait_for(gates)


def _split_heads(mixed: torch.Tensor, hk: int, dk: int, hv: int, dv: int) -> tuple[torch.Tensor, ...]:
    n = mixed.shape[0]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)


def _head_counts(qkv: torch.Tensor, state: torch.Tensor) -> tuple[int, int, int, int]:
    hv, dk, dv = state.shape[1:]
    return (qkv.shape[1] - hv * dv) // (2 * dk), dk, hv, dv


def gated_deltanet_reference(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
    ckpt_offsets: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gated_rms_norm(rule(conv(qkv)), z)`` of the three references; returns ``[N, Hv dv]`` in qkv's dtype.

    ``conv_weight [C, K]``, ``conv_state [S, C, K - 1]`` and the fp32 ``state [S, Hv, dk, dv]`` are read at
    ``slot_ids`` and updated in place, or, with ``state_out_slots [B, max_T]`` (slots other than the inputs),
    written after every token (see :func:`causal_conv1d_reference` and :func:`gated_delta_rule_reference`,
    which also describes ``ckpt_offsets`` / ``ckpt_slots``; their conv windows are not written here).
    """
    hk, dk, hv, dv = _head_counts(qkv, state)
    mixed = causal_conv1d_reference(qkv, conv_weight, conv_state, cu_seqlens, slot_ids, max_seqlen, state_out_slots)
    o = gated_delta_rule_reference(*_split_heads(mixed, hk, dk, hv, dv), a, b, A_log, dt_bias, state, cu_seqlens,
                                   slot_ids, max_seqlen, state_out_slots, ckpt_offsets, ckpt_slots)
    return gated_rms_norm_reference(o, z.view(z.shape[0], hv, dv), norm_weight, eps).reshape(-1, hv * dv)


def fused_decode_enabled() -> bool:
    """On unless ``NINFER_FUSED_DELTANET_DECODE=0``: the one-launch kernel rounds where the composed path does
    (conv sum and SiLU output, the rule's output, the normed value and its product with the weight), so the two
    agree to the bit in the fp16 interpreter tests; the switch keeps the composed path at hand for comparisons."""
    return env_switch("NINFER_FUSED_DELTANET_DECODE", True)


def gates_in_kernel(gates: Gates) -> bool:
    """Whether the one-launch decode applies the gates' projection itself: a :class:`GateProjection` with a float
    weight (its input plain rows, or rows whose norm was deferred: the kernel applies their factors), unless
    ``NINFER_GATES_IN_DECODE=0`` (read per call); the projection's own GEMM otherwise (48 launches a 27B step, on the
    second stream). Run 2026-12-06.7 (H100, on and off alternating): 27B int4 7.28 against 7.51 ms at batch 1,
    35B-A3B 2.56 against 2.67 ms; C = 8 equal; its kernel and whole-model GPU tests passed (runs 2026-12-06.7/.8).
    Not yet measured on an H200 with deferred rows (before them it was 2.4% slower there)."""
    return (isinstance(gates, GateProjection) and isinstance(gates.x, (torch.Tensor, NormedRows))
            and gates.weight is not None and gates.weight.dtype in TL_DTYPE
            and env_switch("NINFER_GATES_IN_DECODE", True))


def fused_decode_applies(qkv: torch.Tensor, state: torch.Tensor, max_seqlen: int | None,
                         state_out_slots: torch.Tensor | None, ckpt_offsets: torch.Tensor | None) -> bool:
    """Whether :func:`gated_deltanet` takes the one-launch decode kernel: on CUDA, a few tokens per sequence
    (decode, speculative verification; never with checkpoints, which the chunked kernel writes in-launch)."""
    few = max_seqlen is not None and max_seqlen <= min(RECURRENT_MAX_SEQLEN, MAX_TOKENS)
    return (fused_decode_enabled() and use_triton(qkv) and few and ckpt_offsets is None
            and check_head_dims(*state.shape[2:])
            and (state_out_slots is None or state_out_slots.shape[1] >= max_seqlen))


def gated_deltanet(
    qkv: torch.Tensor,
    z: torch.Tensor,
    gates: Gates,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
    ckpt_offsets: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`gated_deltanet_reference` (``gates``: its ``(a, b)``, a :class:`GateProjection`, or ``(a, b)``
    computing on another stream, waited for before the first launch that reads them): one kernel at decode on
    CUDA, else conv, rule and norm in turn."""
    hk, dk, hv, dv = _head_counts(qkv, state)
    if fused_decode_applies(qkv, state, max_seqlen, state_out_slots, ckpt_offsets):
        if gates_in_kernel(gates):
            return gated_deltanet_decode_triton(qkv, z, None, None, conv_weight, conv_state, A_log, dt_bias,
                                                norm_weight, eps, state, cu_seqlens, slot_ids, max_seqlen,
                                                state_out_slots, gate_x=gates.x, gate_weight=gates.weight)
        return gated_deltanet_decode_triton(qkv, z, *_gate_values(gates, hv), conv_weight, conv_state, A_log, dt_bias,
                                            norm_weight, eps, state, cu_seqlens, slot_ids, max_seqlen, state_out_slots)
    a, b = _gate_values(gates, hv)
    mixed = causal_conv1d(qkv, conv_weight, conv_state, cu_seqlens, slot_ids, max_seqlen, state_out_slots)
    o = gated_delta_rule(*_split_heads(mixed, hk, dk, hv, dv), a, b, A_log, dt_bias, state, cu_seqlens, slot_ids,
                         max_seqlen, state_out_slots, ckpt_offsets, ckpt_slots)
    return gated_rms_norm(o, z.view(z.shape[0], hv, dv), norm_weight, eps).reshape(-1, hv * dv)
