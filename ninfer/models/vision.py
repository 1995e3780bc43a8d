"""The Qwen3.5 vision encoder (reference §11.1): pixels in, one LLM embedding per 2x2 patch block out.

::

    x = patch_embed(pixels) + interpolate(pos_embed, grid)      # [N_patches, D], merge-block order
    for block in blocks:                                        # attention stays inside each image/frame
        x = x + attn(norm1(x), rope_2d)
        x = x + mlp(norm2(x))
    out = merger(x)                                             # [N_patches / 4, H_text]

Patches arrive flattened ``[N, C * T * P * P]`` in 2x2 merge-block order (the preprocessor's
layout), so every row group of ``merge**2`` consecutive patches is one LLM token. Parameter names
equal the checkpoint's keys under ``model.visual.``. Attention is non-causal within a segment (one
temporal slice of one image or video); the project's paged prefill kernel is causal and paged, so
segments go through torch SDPA, batched by segment length (all frames of a video in one call).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.config import VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches; t counts temporal patch pairs


def block_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an ``h x w`` grid, listed merge block by merge block."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two source taps and weights per target index, ``align_corners=True`` (as transformers computes them)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def pos_embed_taps(grids: Sequence[Grid], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices and weights ``[N, 4]`` that resample the ``side x side`` table to every grid."""
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = block_order(h, w, merge)
        h_taps, h_w = _bilinear_taps(rows, h, side)
        w_taps, w_w = _bilinear_taps(cols, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wt = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        indices.append(idx.repeat(t, 1))
        weights.append(wt.repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def rotary_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """``[N, 2]`` (row, col) rotary positions of every patch, merge-block order, repeated per slice."""
    out = []
    for t, h, w in grids:
        rows, cols = block_order(h, w, merge)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def segment_lengths(grids: Sequence[Grid]) -> list[int]:
    """Attention segments: one per temporal slice of each item, ``h * w`` patches each."""
    return [h * w for t, h, w in grids for _ in range(t)]


def vision_inv_freq(config: VisionConfig, theta: float) -> torch.Tensor:
    """fp32 inverse frequencies of the 2-D rotary: half the head dim rotates by row, half by column."""
    spatial = config.hidden_size // config.num_heads // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Non-causal attention within each segment of ``[N, heads, hd]``; segments of equal length share one SDPA call."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in lengths:
        starts.setdefault(n, []).append(offset)
        offset += n
    for n, group in starts.items():
        idx = (torch.tensor(group, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        # [segments, heads, n, hd]: each segment is one batch row, so no mask is needed.
        qs, ks, vs = (t[idx].view(len(group), n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[idx] = o.transpose(1, 2).reshape(len(group) * n, *q.shape[1:])
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope
        # The 2-D rotary is applied in fp32 over the whole head dim, then cast back (as transformers does).
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        return self.proj(segment_attention(q, k, v, lengths).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        # Checkpoints say gelu_pytorch_tanh; plain "gelu" is the erf form.
        self.approximate = "tanh" if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast") else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each 2x2 block as one ``[4D]`` row through a two-layer MLP (erf GELU)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.unit = config.hidden_size * config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.unit, self.unit)
        self.linear_fc2 = nn.Linear(self.unit, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.unit))))


class PatchEmbed(nn.Module):
    """``Conv3d`` with kernel = stride = patch, stored as the checkpoint's 5-D weight, run as one GEMM."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Module()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, config.in_channels, t, p, p))
        self.proj.bias = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        # A stride-equals-kernel convolution over pre-cut patches is exactly a matmul with the flat kernel.
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionTransformer(nn.Module):
    """``model.visual``: call with flat patches ``[N, C*T*P*P]`` and their grids; returns ``[N / merge**2, H]``."""

    def __init__(self, config: VisionConfig, *, hidden_act: str = "gelu_pytorch_tanh",
                 rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings ** 0.5)
        if self.side * self.side != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {config.num_position_embeddings} is not a square grid")
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config, hidden_act) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.rope_theta = rope_theta
        self.register_buffer("inv_freq", vision_inv_freq(config, rope_theta), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def rope(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[N, 1, head_dim]``: ``[row freqs, col freqs]`` duplicated for rotate-half."""
        pos = rotary_positions(grids, self.merge).to(self.device)
        freqs = pos[..., None].float() * self.inv_freq.to(self.device)  # [N, 2, F]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        grids = [tuple(int(v) for v in g) for g in grids]
        expected = sum(t * h * w for t, h, w in grids)
        if pixels.shape[0] != expected:
            raise ValueError(f"pixel rows ({pixels.shape[0]}) do not match the grids ({expected} patches)")
        x = self.patch_embed(pixels.to(self.device))
        idx, wt = pos_embed_taps(grids, self.side, self.merge)
        # Interpolate in fp32 (the weights are fp32), then round once to the activation dtype.
        pos = (self.pos_embed(idx.to(self.device)) * wt.to(self.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        rope, lengths = self.rope(grids), segment_lengths(grids)
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)
