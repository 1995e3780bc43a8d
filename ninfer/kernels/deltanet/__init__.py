"""Gated DeltaNet: the gated delta rule over a ragged batch with fp32 state slots (see :mod:`.dispatch`).

Modules, bottom up: ``common`` (fused gates, L2 norm, supported head dims), the kernels ``recurrent``
(decode) and ``chunk`` (chunked WY/UT form), the plain-PyTorch ``reference`` and ``dispatch``; then the
whole mixer after the projections (conv, rule, gated norm): the one-launch decode kernel ``decode`` and
its reference and dispatcher ``mixer``.
"""
from ninfer.kernels.deltanet.chunk import chunked_batch_sizes
from ninfer.kernels.deltanet.dispatch import RECURRENT_MAX_SEQLEN, gated_delta_rule
from ninfer.kernels.deltanet.mixer import GateProjection, gated_deltanet, gated_deltanet_reference
from ninfer.kernels.deltanet.reference import CHUNK, chunked_rule, gated_delta_rule_reference, recurrent_rule

__all__ = ["CHUNK", "GateProjection", "RECURRENT_MAX_SEQLEN", "chunked_batch_sizes", "chunked_rule", "gated_delta_rule",
           "gated_delta_rule_reference", "gated_deltanet", "gated_deltanet_reference", "recurrent_rule"]
