"""The Qwen3.5 text decoder (dense and MoE): ``(L/4) x [DeltaNet, DeltaNet, DeltaNet, Attention]``.

::

    x = embed(ids)
    for layer in layers:
        x = x + mixer(input_layernorm(x))          # Gated DeltaNet or gated attention
        x = x + ffn(post_attention_layernorm(x))   # SwiGLU MLP or MoE block
    logits = lm_head(norm(x))                      # decode graphs: the norm in the head's GEMM prologue
"""
from __future__ import annotations

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.norms import Normed, materialize
from ninfer.kernels.rope import mrope_cos_sin, rope_inv_freq
from ninfer.models.batch import ForwardBatch
from ninfer.models.cache import ModelCache
from ninfer.models.layers import MLP, GatedAttention, GatedDeltaNet, RMSNorm, linear
from ninfer.models.moe import SparseMoeBlock


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                cache: ModelCache) -> torch.Tensor:
        """The residual stream in, the residual stream out. Each norm is deferred to the projections that read
        it (the quantized decode GEMMs fold it into their prologue) and each add is the last projection's
        epilogue (o_proj / out_proj, down_proj)."""
        h = self.input_layernorm.deferred(x)
        if self.is_attention:
            x = self.self_attn(h, rope, batch, cache, residual=x)      # x + attn(norm1(x))
        else:
            x = self.linear_attn(h, batch, cache, residual=x)          # x + deltanet(norm1(x))
        return self.mlp(self.post_attention_layernorm.deferred(x), residual=x)  # x + ffn(norm2(x))


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

    def forward(self, batch: ForwardBatch, cache: ModelCache, inputs_embeds: torch.Tensor | None = None, *,
                defer_norm: bool = False) -> torch.Tensor | Normed:
        """Hidden states ``[N, H]`` after the final norm for every token of the batch (the MTP input too).

        ``inputs_embeds`` replaces the token embeddings (multimodal prompts put vision features there).
        ``defer_norm``: the final norm deferred to :meth:`logits` (a quantized LM head applies it in its GEMM's
        prologue at decode), for callers that want only the logits of every token (the decode graphs).
        """
        x = self.embed_tokens(batch.input_ids) if inputs_embeds is None else inputs_embeds
        rope = mrope_cos_sin(batch.positions, self.inv_freq, list(self.config.mrope_section), x.dtype)
        for layer in self.layers:
            x = layer(x, rope, batch, cache)
        return self.norm.deferred(x) if defer_norm else self.norm(x)

    def logits(self, hidden: torch.Tensor | Normed) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if isinstance(self.embed_tokens, nn.Embedding):  # tied: the embedding doubles as the head
            return torch.nn.functional.linear(materialize(hidden), self.embed_tokens.weight)
        return self.embed_tokens.as_linear()(hidden)  # a quantized tied embedding
