"""Building blocks of the Qwen3.5 text decoder, written to read like the math (reference §4-§8).

Parameter names equal the checkpoint's keys, so loading is a plain name match, except for fused
projections: several projections of one input stored as one module over their stacked rows, so that
they run as one GEMM (at decode every projection is a launch, and a gap before the next one). A module
holding them declares ``fused_rows``: fused attribute -> the checkpoint projections it stacks, in row
order, with their row counts; the loader fills each part's rows from the checkpoint's separate tensors
(``ninfer.checkpoint.fused_parts``) and recipes select formats by the parts' names. Tokens are packed
``[N, ...]``; a :class:`ForwardBatch` says which sequence each token belongs to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.activations import swiglu as swiglu_op
from ninfer.kernels.attention import paged_attention, qk_norm_rope_write_kv
from ninfer.kernels.conv import save_conv_windows
from ninfer.kernels.deltanet import GateProjection, gated_deltanet
from ninfer.kernels.float_gemv import float_linear
from ninfer.kernels.norms import NormedRows, as_rows, gated_rms_norm, rms_norm
from ninfer.models.batch import ForwardBatch
from ninfer.models.cache import ModelCache
from ninfer.quant.linear import QuantLinear

FusedRows = dict[str, tuple[tuple[str, int], ...]]  # fused attribute -> ((part attribute, rows), ...)


class Linear(nn.Linear):
    """A float projection without bias. The small ones that recipes keep in bf16 (routers, the DeltaNet a/b gates)
    run at decode sizes as cuBLAS or one Triton launch, whichever the tuner timed faster
    (:func:`~ninfer.kernels.float_gemv.float_linear`); everything else is ``F.linear``."""

    def forward(self, x: torch.Tensor | NormedRows) -> torch.Tensor:
        return float_linear(x, self.weight)


def linear(in_features: int, out_features: int) -> Linear:
    return Linear(in_features, out_features, bias=False)


class GateUpLinear(nn.Linear):
    """The stacked gate/up projection of a SwiGLU MLP (gate rows first). Its forward takes the
    ``swiglu`` flag of :class:`ninfer.quant.linear.QuantLinear`, so the MLP reads the same float or
    quantized: quantized weights apply SwiGLU in the GEMM's epilogue, float ones in the SwiGLU kernel."""

    def __init__(self, in_features: int, intermediate_size: int) -> None:
        super().__init__(in_features, 2 * intermediate_size, bias=False)

    def forward(self, x: torch.Tensor | NormedRows, swiglu: bool = False) -> torch.Tensor:
        y = F.linear(as_rows(x), self.weight)
        return swiglu_op(y) if swiglu else y


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


def project_then_norm(proj: nn.Module, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None,
                      defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
    """``norm(proj(x), residual)``: a layer's output projection and the norm after it. A quantized projection
    (``QuantLinear.forward_then_norm``) may apply the norm in its GEMM's launch or, with ``defer`` (every reader of
    the normed rows takes :class:`~ninfer.kernels.norms.NormedRows`: :func:`reads_deferred_norm`), leave it to them."""
    then_norm = getattr(proj, "forward_then_norm", None)
    if then_norm is not None:
        return then_norm(x, norm.weight, norm.eps, residual, defer=defer)
    return norm(proj(x), residual)


def reads_deferred_norm(*projections: nn.Module) -> bool:
    """Whether these projections of a norm's output all normalize :class:`~ninfer.kernels.norms.NormedRows`
    themselves (a quantized GEMM or the float GEMV; anything else would materialize them: another launch)."""
    return all(isinstance(p, (QuantLinear, Linear)) for p in projections)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, gate and up as one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.fused_rows: FusedRows = {"gate_up_proj": (("gate_proj", intermediate_size),
                                                       ("up_proj", intermediate_size))}

    def forward(self, x: torch.Tensor | NormedRows) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, swiglu=True))

    def forward_then_norm(self, x: torch.Tensor | NormedRows, norm: RMSNorm, residual: torch.Tensor | None,
                          defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
        """``norm(self(x), residual)`` (the MoE block applies it in its combine's launch, a quantized down
        projection may in its GEMM's, or leave it to the readers: ``defer``)."""
        return project_then_norm(self.down_proj, self.gate_up_proj(x, swiglu=True), norm, residual, defer)

    @property
    def reads_deferred_norm(self) -> bool:
        return reads_deferred_norm(self.gate_up_proj)


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norm, partial RoPE, GQA and a sigmoid output gate (§6)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        hidden = config.hidden_size
        # Rows: the checkpoint's q_proj (interleaved per head: [query_h | gate_h] blocks of head_dim
        # each), then k_proj, then v_proj.
        q_rows, kv_rows = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(hidden, q_rows + 2 * kv_rows)
        self.qkv_sizes = [q_rows, kv_rows, kv_rows]
        self.fused_rows: FusedRows = {"qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))}
        self.o_proj = linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, cache: ModelCache
    ) -> torch.Tensor:
        return self.o_proj(self._attend(x, rope, batch, cache))

    def forward_then_norm(self, x: torch.Tensor | NormedRows, rope: tuple[torch.Tensor, torch.Tensor],
                          batch: ForwardBatch, cache: ModelCache, norm: RMSNorm, residual: torch.Tensor | None,
                          defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
        """``norm(self(x), residual)``, through :func:`project_then_norm`."""
        return project_then_norm(self.o_proj, self._attend(x, rope, batch, cache), norm, residual, defer)

    @property
    def reads_deferred_norm(self) -> bool:
        return reads_deferred_norm(self.qkv_proj)

    def _attend(
        self, x: torch.Tensor | NormedRows, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
        cache: ModelCache,
    ) -> torch.Tensor:
        """The gated attention output before ``o_proj``, ``[N, heads * head_dim]``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # column views: the kernels take row strides
        q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        # Per-head q/k norm, partial RoPE and the K/V write into the cache (one launch on CUDA, two with
        # NINFER_FUSED_PROLOGUE=0).
        kv = cache.kv[self.layer_idx]
        q = qk_norm_rope_write_kv(q, k, v, self.q_norm.weight, self.k_norm.weight, *rope, self.q_norm.eps, kv,
                                  batch.slot_mapping)
        # The sigmoid output gate is fused into the attention epilogue.
        o = paged_attention(q, kv, batch.block_tables, batch.cu_seqlens, batch.context_lens,
                            self.head_dim ** -0.5, batch.max_seqlen, gate=gate)
        return o.reshape(n, -1)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention with causal conv and gated output norm (§8)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.key_dim, config.value_dim
        hidden = config.hidden_size
        self.conv_dim = config.conv_dim
        # rows: in_proj_qkv (q, k, v; each head-major), then in_proj_z. a and b have their own module: recipes
        # keep them in bf16 while q/k/v/z are quantized, and one fused module has one format.
        self.in_proj_qkvz = linear(hidden, config.conv_dim + self.value_dim)
        self.in_proj_ab = linear(hidden, 2 * self.num_v_heads)  # rows: in_proj_a, then in_proj_b
        self.fused_rows: FusedRows = {"in_proj_qkvz": (("in_proj_qkv", config.conv_dim), ("in_proj_z", self.value_dim)),
                                      "in_proj_ab": (("in_proj_a", self.num_v_heads), ("in_proj_b", self.num_v_heads))}
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(config.conv_dim, 1, config.linear_conv_kernel_dim))
        # Decay parameters stay fp32 whatever the model dtype: exp(A_log) overflows in fp16.
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = linear(self.value_dim, hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        return self.out_proj(self._mix(x, batch, cache))

    def forward_then_norm(self, x: torch.Tensor | NormedRows, batch: ForwardBatch, cache: ModelCache, norm: RMSNorm,
                          residual: torch.Tensor | None,
                          defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
        """``norm(self(x), residual)``, through :func:`project_then_norm`."""
        return project_then_norm(self.out_proj, self._mix(x, batch, cache), norm, residual, defer)

    @property
    def reads_deferred_norm(self) -> bool:
        return reads_deferred_norm(self.in_proj_qkvz, self.in_proj_ab)

    def _mix(self, x: torch.Tensor | NormedRows, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The gated-norm output of the delta rule before ``out_proj``, ``[N, value_dim]``."""
        # a, b = in_proj_ab(x), started first: in a captured decode step its small GEMM runs on a second stream
        # beside the q/k/v/z projection (or the decode kernel applies the float weight itself: no GEMM launch)
        ab = GateProjection(x, self.in_proj_ab, getattr(self.in_proj_ab, "weight", None))
        gates = ab.started(self.num_v_heads)
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)  # column views (row strides)
        if batch.checkpoints:
            save_conv_windows(qkv, cache.conv[self.layer_idx], batch.checkpoints)
        # conv + SiLU -> gated delta rule -> gated RMSNorm (one kernel at decode; the dispatcher decides)
        o = gated_deltanet(
            qkv, z, gates, self.conv1d.weight[:, 0, :], cache.conv[self.layer_idx], self.A_log, self.dt_bias,
            self.norm.weight, self.norm.eps, cache.recurrent[self.layer_idx], batch.cu_seqlens, batch.state_slots,
            batch.max_seqlen, state_out_slots=batch.state_out_slots, ckpt_offsets=batch.ckpt_offsets,
            ckpt_slots=batch.ckpt_slots,
        )
        return o
