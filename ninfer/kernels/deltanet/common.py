"""Pieces the Gated DeltaNet kernels share: the fused gates (decay and beta), the q/k L2 norm, and the
head dims the kernels support."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decay_beta(a, b, neg_A, dt_bias):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (``neg_A = -exp(A_log)``) and ``beta = sigmoid(b)``, fp32."""
    x = a.to(tl.float32) + dt_bias
    # torch's softplus switches to the identity above 20, where log(1 + exp(x)) == x in fp32 anyway.
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return neg_A * softplus, tl.sigmoid(b.to(tl.float32))


@triton.jit
def l2_normalize(x, scale, AXIS: tl.constexpr):
    """``x / sqrt(sum(x^2) + 1e-6) * scale`` along ``AXIS``, in fp32."""
    x = x.to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) + 1e-6) * scale)


def check_head_dims(dk: int, dv: int) -> bool:
    """Head dims the kernels support: powers of two (block shapes), at least 16 (matmul tiles)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))
