"""The multi-token-prediction (MTP) head of Qwen3.5 and greedy K-step drafting (reference §10).

One draft step for the pair (hidden state ``h_t`` of position ``t``, token ``x_{t+1}``)::

    x  = fc(cat([pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]))   # embedding FIRST
    x  = layers.0(x, position t)       # one gated full-attention decoder layer with its own paged KV
    h' = norm(x)                       # final residual add, then the zero-centred norm
    logits = lm_head(h')               # proposes x_{t+2}

The embedding and LM head belong to the target model and are shared, not copied. Drafting applies
the one layer recursively: step ``i`` takes the previous ``h'`` and its own argmax token, one
position further on, and writes one more MTP KV entry.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from ninfer.checkpoint import CheckpointError, fill_module, fused_parts, materialize
from ninfer.config import ModelConfig
from ninfer.kernels.rope import mrope_cos_sin, rope_inv_freq
from ninfer.models.batch import ForwardBatch, make_batch
from ninfer.models.cache import ModelCache
from ninfer.models.layers import RMSNorm, linear
from ninfer.models.qwen3_5 import DecoderLayer, Qwen3_5TextModel
from ninfer.quant.linear import prepare_model_

_PER_EXPERT = re.compile(r"^layers\.0\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The text config narrowed to the MTP stack: one full-attention layer, no DeltaNet layers.

    With it, the main model's :class:`DecoderLayer` builds exactly the MTP layer (gated attention,
    dense MLP or MoE block) and :class:`ModelCache` allocates exactly its KV (``kv[0]``).
    """
    return dataclasses.replace(config, num_hidden_layers=1, layer_types=("full_attention",))


class MTPCache(ModelCache):
    """Paged KV for the MTP attention layer only (``kv[0]``; no DeltaNet state slots).

    It is separate from the target's cache because the MTP layer's K/V are different tensors; it
    can share the target's page tables when it has the same ``num_pages``/``page_size``, since
    the MTP entry of position ``t`` lives in the same slot as the target's token ``t``.
    """

    def __init__(self, config: ModelConfig, *, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype, kv_dtype: str = "auto") -> None:
        super().__init__(mtp_layer_config(config), num_pages=num_pages, page_size=page_size, num_slots=0,
                         device=device, dtype=dtype, kv_dtype=kv_dtype)


class MTPHead(nn.Module):
    """The MTP head; parameter names are the checkpoint's ``mtp.*`` keys without the prefix."""

    target: Qwen3_5TextModel  # the model whose embedding and LM head the head shares

    def __init__(self, config: ModelConfig, target: Qwen3_5TextModel) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = linear(2 * hidden, hidden)
        self.layers = nn.ModuleList([DecoderLayer(mtp_layer_config(config), 0)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Kept outside the module tree on purpose: the embedding and LM head are the target's, so
        # they must not appear in this head's parameters/state_dict nor move with ``head.to()``.
        object.__setattr__(self, "target", target)
        self.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @classmethod
    def from_report(cls, model: Qwen3_5TextModel, tensors: dict[str, torch.Tensor],
                    plan: dict[str, str] | None = None) -> MTPHead:
        """Build the head from ``LoadReport.mtp`` (``mtp.*`` tensors, prefix removed, as stored).

        Float tensors become the parameters (in the model's dtype, on its device), except that per-expert MoE
        tensors are stacked into the fused ``[E, 2I, H]`` / ``[E, H, I]`` parameters, gate rows first, and the
        parts of each fused projection into its rows (``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj``,
        ...). ``plan`` (weight name without ``mtp.`` -> format): the head of a quantized checkpoint, whose
        planned weights are stored packed and load into quantized modules as the text model's do. Raises
        :class:`CheckpointError` naming the first missing, unexpected or misshapen tensor.
        """
        if not tensors:
            raise CheckpointError("the checkpoint has no mtp.* tensors: this model has no MTP head to draft with")
        if model.config.mtp_num_hidden_layers > 1:
            raise CheckpointError(f"mtp_num_hidden_layers={model.config.mtp_num_hidden_layers}: only one MTP "
                                  "layer is supported (every released Qwen3.5 checkpoint has one)")
        if plan and any(fmt != "bf16" for fmt in plan.values()):
            return cls._from_packed(model, tensors, plan)
        with torch.device("meta"):
            head = cls(model.config, model)
        dtype = model.dtype
        tensors = _stack_fused(head, _stack_experts(head, tensors))
        expected = dict(head.named_parameters())
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected:
            raise CheckpointError(f"unexpected tensor mtp.{unexpected[0]} (no such parameter in the MTP head built "
                                  "from config.json)")
        for name, param in expected.items():
            if name not in tensors:
                raise CheckpointError(f"tensor mtp.{name} is missing from the checkpoint "
                                      f"(expected shape {list(param.shape)})")
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(f"tensor mtp.{name} has shape {list(tensor.shape)} but config.json implies "
                                      f"{list(param.shape)}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"tensor mtp.{name} has dtype {tensor.dtype}, but the checkpoint's quantization "
                                      "plan names no format for it")
            module_name, _, attr = name.rpartition(".")
            module = head.get_submodule(module_name) if module_name else head
            setattr(module, attr, nn.Parameter(tensor.to(device=model.device, dtype=dtype), requires_grad=False))
        head.inv_freq = rope_inv_freq(model.config.rotary_dim, model.config.rope_theta).to(model.device)
        return head.eval()

    @classmethod
    def _from_packed(cls, model: Qwen3_5TextModel, tensors: dict[str, torch.Tensor], plan: dict[str, str]) -> MTPHead:
        with torch.device("meta"):
            head = cls(model.config, model)
        prepare_model_(head, plan, dtype=model.dtype)
        materialize(head, model.device, model.dtype)
        try:
            fill_module(head, ((name, t.to(model.device)) for name, t in tensors.items()),
                        source="the MTP head (mtp.* tensors)")
        except CheckpointError as err:
            raise CheckpointError(f"MTP head: {err}") from None
        head.inv_freq = rope_inv_freq(model.config.rotary_dim, model.config.rope_theta).to(model.device)
        return head.eval()

    def allocate_cache(self, *, num_pages: int, page_size: int, kv_dtype: str = "auto") -> MTPCache:
        return MTPCache(self.config, num_pages=num_pages, page_size=page_size, device=self.device,
                        dtype=self.norm.weight.dtype, kv_dtype=kv_dtype)

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch,
                cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [N, H]``: the target's final-norm states at positions t (``batch.positions``);
        ``next_token_ids [N]``: the tokens at t+1. Writes the MTP K/V at ``batch.slot_mapping``.

        Returns ``(h' [N, H], logits [N, V])``; ``h'`` is the ``hidden`` of the next draft step.
        ``batch.input_ids`` is not read: the tokens are ``next_token_ids``, shifted by one from the
        positions, exactly as the pairs are formed (reference §10.2).
        """
        h_prime = self.advance(hidden, next_token_ids, batch, cache)
        return h_prime, self.target.logits(h_prime)

    def advance(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch,
                cache: ModelCache) -> torch.Tensor:
        """:meth:`forward` without the LM head: ``h'`` only. A prompt's pairs need just the K/V this writes,
        and logits over every pair of a long chunk would cost an LM head GEMM of the chunk's length."""
        target = self.target
        e, _ = self.pre_fc_norm_embedding(target.embed_tokens(next_token_ids))
        h, _ = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        rope = mrope_cos_sin(batch.positions, self.inv_freq, list(self.config.mrope_section), x.dtype)
        layer = self.layers[0]
        h, residual = layer.input_layernorm(x)
        h_prime, _ = layer(h, residual, rope, batch, cache, self.norm)
        return h_prime


def _stack_experts(head: MTPHead, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace per-expert ``layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`` by the stacked pair."""
    per_expert = {k: m for k in tensors if (m := _PER_EXPERT.match(k))}
    if not per_expert:
        return tensors
    if not head.config.is_moe:
        raise CheckpointError(f"unexpected tensor mtp.{min(per_expert)}: config.json describes a dense model")
    out = {k: v for k, v in tensors.items() if k not in per_expert}
    parts = {(int(m.group(1)), m.group(2)): tensors[k] for k, m in per_expert.items()}
    num_experts = head.config.num_experts
    for e, proj in sorted(parts):
        if e >= num_experts:
            raise CheckpointError(f"tensor mtp.layers.0.mlp.experts.{e}.{proj}_proj.weight: expert {e} is beyond "
                                  f"num_experts={num_experts} in config.json")
    hidden, inter = head.config.hidden_size, head.config.moe_intermediate_size
    gate_up, down = [], []
    for e in range(num_experts):
        for proj, like in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            name = f"layers.0.mlp.experts.{e}.{proj}_proj.weight"
            if (e, proj) not in parts:
                raise CheckpointError(f"tensor mtp.{name} is missing from the checkpoint")
            if tuple(parts[(e, proj)].shape) != like:
                raise CheckpointError(f"tensor mtp.{name} has shape {list(parts[(e, proj)].shape)} but config.json "
                                      f"implies {list(like)}")
        gate_up.append(torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0))
        down.append(parts[(e, "down")])
    out["layers.0.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["layers.0.mlp.experts.down_proj"] = torch.stack(down)
    return out


def _stack_fused(head: MTPHead, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace the checkpoint's parts of each fused projection (``layers.0.self_attn.q_proj.weight``, ...)
    by the fused weight, their rows in order."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for part, where in sorted(fused_parts(head).items(), key=lambda item: (item[1].module, item[1].start)):
        groups.setdefault(where.module, []).append((part, where.stop - where.start))
    params = dict(head.named_parameters())
    out = dict(tensors)
    for module, parts in groups.items():
        if f"{module}.weight" in out:
            continue  # stored fused already
        width = params[f"{module}.weight"].shape[1]
        rows = []
        for part, count in parts:
            name = f"{part}.weight"
            if name not in out:
                raise CheckpointError(f"tensor mtp.{name} is missing from the checkpoint (expected shape "
                                      f"{[count, width]})")
            tensor = out.pop(name)
            if tuple(tensor.shape) != (count, width):
                raise CheckpointError(f"tensor mtp.{name} has shape {list(tensor.shape)} but config.json implies "
                                      f"{[count, width]}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"tensor mtp.{name} has dtype {tensor.dtype}, but the checkpoint's "
                                      "quantization plan names no format for it")
            rows.append(tensor)
        out[f"{module}.weight"] = torch.cat(rows)
    return out


def single_token_batch(token: int, position: int, *, block_table: torch.Tensor, page_size: int,
                       rope_delta: int = 0) -> ForwardBatch:
    """A one-sequence, one-token batch at token index ``position`` (its KV slot follows ``block_table``).

    ``rope_delta`` shifts the rotary position only (multimodal prompts, reference §11.4), not the slot.
    """
    page = int(block_table[position // page_size])
    return make_batch(
        input_ids=[token], positions=[position + rope_delta], seq_lens=[1], context_lens=[position + 1],
        block_tables=block_table.to(torch.int32)[None], slot_mapping=[page * page_size + position % page_size],
        state_slots=[0],  # unused: no DeltaNet layer
    )


@torch.inference_mode()
def draft(model: Qwen3_5TextModel, head: MTPHead, last_hidden: torch.Tensor, last_token: int, position: int,
          k: int, *, cache: ModelCache, block_table: torch.Tensor, rope_delta: int = 0,
          vocab_limit: int | None = None) -> list[int]:
    """Greedy K-step drafting for one sequence; returns the proposed tokens for positions
    ``position + 2 .. position + k + 1``.

    ``last_hidden [H]`` is the target's final-norm state at token index ``position`` and
    ``last_token`` the token sampled from it (index ``position + 1``). The MTP cache must already
    hold this sequence's entries ``0 .. position - 1`` (the head run over the earlier pairs);
    step ``i`` writes entry ``position + i``, so ``block_table`` must cover ``position + k - 1``.
    ``vocab_limit`` keeps drafts below the tokenizer's vocabulary (the LM head is padded).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if model is not head.target:
        raise ValueError("the MTP head was built for a different target model (its embedding and LM head)")
    hidden = last_hidden.reshape(1, -1)
    token, drafts = last_token, []
    for i in range(k):
        batch = single_token_batch(token, position + i, block_table=block_table, page_size=cache.page_size,
                                   rope_delta=rope_delta)
        hidden, logits = head(hidden, batch.input_ids, batch, cache)
        token = int(logits[0, :vocab_limit].argmax())
        drafts.append(token)
    return drafts
