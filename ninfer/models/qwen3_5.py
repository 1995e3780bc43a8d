"""The Qwen3.5 text decoder (dense and MoE): ``(L/4) x [DeltaNet, DeltaNet, DeltaNet, Attention]``.

::

    x = embed(ids)
    for layer in layers:
        x = x + mixer(input_layernorm(x))          # Gated DeltaNet or gated attention
        x = x + ffn(post_attention_layernorm(x))   # SwiGLU MLP or MoE block
    logits = lm_head(norm(x))

Each layer ends with the norm that follows it (the next layer's ``input_layernorm``, or ``norm``), so that the
MoE block can apply it inside its combine's launch.
"""
from __future__ import annotations

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.rope import mrope_cos_sin, rope_inv_freq
from ninfer.models.batch import ForwardBatch
from ninfer.models.cache import ModelCache
from ninfer.models.layers import MLP, GatedAttention, GatedDeltaNet, RMSNorm, linear
from ninfer.models.moe import SparseMoeBlock
from ninfer.quant.linear import QuantWeight


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        self.mlp = SparseMoeBlock(config) if config.is_moe else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        cache: ModelCache,
        next_norm: RMSNorm,
        next_reads_deferred: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes this layer's input already through its ``input_layernorm`` (with the residual stream), and returns
        the next one's the same way: its output through ``next_norm`` (the next layer's input norm, or the model's
        final norm), which the MoE block applies inside its last launch. The residual adds are fused into the norms,
        and the norms left to the projections that read the normed rows where all of them can (``NINFER_DEFERRED_NORM``;
        ``next_reads_deferred``: the next layer's do), or else applied by the output projections' GEMMs at a few
        tokens (``NINFER_NORM_IN_GEMM``)."""
        mixer = self.self_attn if self.is_attention else self.linear_attn
        defer = self.mlp.reads_deferred_norm
        if self.is_attention:
            h, residual = mixer.forward_then_norm(h, rope, batch, cache, self.post_attention_layernorm, residual, defer)
        else:
            h, residual = mixer.forward_then_norm(h, batch, cache, self.post_attention_layernorm, residual, defer)
        return self.mlp.forward_then_norm(h, next_norm, residual, next_reads_deferred)

    @property
    def reads_deferred_norm(self) -> bool:
        """Whether the projections that read this layer's normed input normalize deferred rows themselves."""
        return (self.self_attn if self.is_attention else self.linear_attn).reads_deferred_norm


class Qwen3_5TextModel(nn.Module):
    """Token ids in, final-norm hidden states out; :meth:`logits` applies the LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else linear(config.hidden_size, config.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (norm weights are never quantized)."""
        return self.norm.weight.dtype

    def forward(self, batch: ForwardBatch, cache: ModelCache, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[N, H]`` after the final norm for every token of the batch (the MTP input too).

        ``inputs_embeds`` replaces the token embeddings (multimodal prompts put vision features there).
        """
        x = self.embed_tokens(batch.input_ids) if inputs_embeds is None else inputs_embeds
        rope = mrope_cos_sin(batch.positions, self.inv_freq, list(self.config.mrope_section), x.dtype)
        h, residual = self.layers[0].input_layernorm(x)
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        # the final norm's rows go to the LM head, the MTP head and the sampler's row selection: never deferred
        deferred_after = [layer.reads_deferred_norm for layer in self.layers[1:]] + [False]
        for layer, next_norm, deferred in zip(self.layers, norms_after, deferred_after, strict=True):
            h, residual = layer(h, residual, rope, batch, cache, next_norm, deferred)
        return h

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the LM head, ``[len(ids), H]`` in the compute dtype (dequantized where it is
        quantized), so that ``hidden @ rows.T`` equals ``logits(hidden)[:, ids]`` up to rounding."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(head, QuantWeight):
            return head.packed().dequantize_rows(ids, self.dtype)
        return head.weight.index_select(0, ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if isinstance(self.embed_tokens, nn.Embedding):  # tied: the embedding doubles as the head
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.embed_tokens.as_linear()(hidden)  # a quantized tied embedding
