"""Building blocks of the Qwen3.5 text decoder, written to read like the math (reference §4-§8).

Parameter names equal the checkpoint's keys, so loading is a plain name match. Tokens are packed
``[N, ...]``; a :class:`ForwardBatch` says which sequence each token belongs to.
"""
from __future__ import annotations

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.activations import swiglu
from ninfer.kernels.attention import paged_attention, write_kv
from ninfer.kernels.conv import causal_conv1d, save_conv_windows
from ninfer.kernels.deltanet import gated_delta_rule
from ninfer.kernels.norms import gated_rms_norm, rms_norm
from ninfer.kernels.rope import qk_norm_rope
from ninfer.models.batch import ForwardBatch
from ninfer.models.cache import ModelCache
from ninfer.models.fused import FusedRows, fuse_into, fused_of


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (``1 + w``), optionally adding the residual first."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: plain scale ``w``, then ``* silu(z)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``.

    After :meth:`fuse_` gate and up are one GEMM over their stacked rows (:mod:`ninfer.models.fused`):
    quantized weights apply SwiGLU in its epilogue, float ones feed the SwiGLU kernel without a
    concatenation. ``gate_proj`` / ``up_proj`` stay, as views of the stacked storage.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up
        if fused is None:
            return self.down_proj(swiglu(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))
        if isinstance(fused.weight, torch.Tensor):
            return self.down_proj(swiglu(fused(x)))
        return self.down_proj(fused(x, swiglu=True))

    @property
    def gate_up(self) -> FusedRows | None:
        """The fused gate/up projection, or None (unfused, or a parameter replaced since)."""
        return fused_of(self, "_gate_up")

    def fuse_(self) -> bool:
        """Fuse gate and up (:func:`ninfer.models.fused.fuse_into`)."""
        return fuse_into(self, "_gate_up", [self.gate_proj, self.up_proj])


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norm, partial RoPE, GQA and a sigmoid output gate (§6)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        hidden = config.hidden_size
        # q_proj rows interleave per head: [query_h | gate_h] blocks of head_dim each.
        self.q_proj = linear(hidden, 2 * self.num_heads * self.head_dim)
        self.k_proj = linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, cache: ModelCache
    ) -> torch.Tensor:
        n = x.shape[0]
        fused = self.qkv_proj
        if fused is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # one GEMM, three column views (the kernels below take row strides)
            q, k, v = fused(x).split(fused.sizes, dim=-1)
        q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        # Per-head q/k norm, then partial RoPE: one fused op.
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, *rope, self.q_norm.eps)

        kv = cache.kv[self.layer_idx]
        write_kv(k, v, kv, batch.slot_mapping)
        # The sigmoid output gate is fused into the attention epilogue.
        o = paged_attention(q, kv, batch.block_tables, batch.cu_seqlens, batch.context_lens,
                            self.head_dim ** -0.5, batch.max_seqlen, gate=gate)
        return self.o_proj(o.reshape(n, -1))

    @property
    def qkv_proj(self) -> FusedRows | None:
        """``q_proj``, ``k_proj`` and ``v_proj`` as one projection (:mod:`ninfer.models.fused`), or None."""
        return fused_of(self, "_qkv")

    def fuse_(self) -> bool:
        """Fuse the q, k and v projections (:func:`ninfer.models.fused.fuse_into`)."""
        return fuse_into(self, "_qkv", [self.q_proj, self.k_proj, self.v_proj])


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention with causal conv and gated output norm (§8)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.key_dim, config.value_dim
        hidden = config.hidden_size
        self.in_proj_qkv = linear(hidden, config.conv_dim)  # rows: q, k, v; each head-major
        self.in_proj_z = linear(hidden, self.value_dim)
        self.in_proj_b = linear(hidden, self.num_v_heads)
        self.in_proj_a = linear(hidden, self.num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(config.conv_dim, 1, config.linear_conv_kernel_dim))
        # Decay parameters stay fp32 whatever the model dtype: exp(A_log) overflows in fp16.
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = linear(self.value_dim, hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.in_proj_qkv(x)
        if batch.checkpoints:
            save_conv_windows(qkv, cache.conv[self.layer_idx], batch.checkpoints)
        mixed = causal_conv1d(qkv, self.conv1d.weight[:, 0, :], cache.conv[self.layer_idx],
                              batch.cu_seqlens, batch.state_slots, batch.max_seqlen, batch.state_out_slots)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        ab = self.in_proj_ab
        if ab is None:
            a, b = self.in_proj_a(x), self.in_proj_b(x)
        else:  # one GEMM, two column views (the kernels take row strides)
            a, b = ab(x).split(ab.sizes, dim=-1)
        o = gated_delta_rule(
            q.reshape(n, self.num_k_heads, self.head_k_dim), k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim), a, b,
            self.A_log, self.dt_bias, cache.recurrent[self.layer_idx], batch.cu_seqlens, batch.state_slots,
            batch.max_seqlen, state_out_slots=batch.state_out_slots, ckpt_offsets=batch.ckpt_offsets,
            ckpt_slots=batch.ckpt_slots,
        )
        z = self.in_proj_z(x).reshape(n * self.num_v_heads, self.head_v_dim)
        o = self.norm(o.reshape(n * self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.reshape(n, self.value_dim))

    @property
    def in_proj_ab(self) -> FusedRows | None:
        """``in_proj_a`` and ``in_proj_b`` as one projection (:mod:`ninfer.models.fused`), or None."""
        return fused_of(self, "_ab")

    def fuse_(self) -> bool:
        """Fuse ``in_proj_a`` and ``in_proj_b`` (:func:`ninfer.models.fused.fuse_into`)."""
        return fuse_into(self, "_ab", [self.in_proj_a, self.in_proj_b])
