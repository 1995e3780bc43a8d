"""Running a multimodal prompt through the text model: vision embeddings scattered into the token rows.

``forward_embeds`` is ``Qwen3_5TextModel.forward`` with the embedding lookup replaced by given
``inputs_embeds`` (the M-RoPE tables come from ``batch.positions``, which for a multimodal prompt
are the 3-axis positions of :func:`ninfer.vision.prompt.rope_index`). Prefill chunks are built by
:func:`chunk_embeds`, so a prompt can be split anywhere, even inside an image.

:class:`MultimodalRunner` is the one-sequence driver (like ``runtime.sequence.SequenceRunner``):
prefill, then decode steps at ``len + rope_delta``; scoring and the parity tests use it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.models.batch import ForwardBatch
from ninfer.models.cache import ModelCache
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.models.vision import VisionTransformer
from ninfer.vision.prompt import MultimodalPrompt, PreparedMedia


@torch.inference_mode()
def encode_media(tower: VisionTransformer, media: Sequence[PreparedMedia]) -> list[torch.Tensor]:
    """Merged vision embeddings, one ``[tokens, H]`` tensor per item; one tower call for all of them.

    Attention never crosses an image or a frame, so batching items changes nothing numerically.
    """
    if not media:
        return []
    out = tower(torch.cat([m.pixels for m in media]), [m.grid for m in media])
    unit = tower.merge ** 2
    return list(out.split([m.grid[0] * m.grid[1] * m.grid[2] // unit for m in media]))


def chunk_embeds(model: Qwen3_5TextModel, prompt: MultimodalPrompt, media_embeds: torch.Tensor,
                 start: int, end: int) -> torch.Tensor:
    """Input embeddings of prompt tokens ``[start, end)``: token embeddings, media rows replaced."""
    device = model.device
    x = model.embed_tokens(torch.tensor(prompt.input_ids[start:end], dtype=torch.long, device=device))
    index = prompt.media_index[start:end]
    rows = index >= 0
    if bool(rows.any()):
        x[rows.to(device)] = media_embeds[index[rows].to(device)].to(x.dtype)
    return x


@dataclass
class MultimodalInputs:
    """What an engine request carries for a multimodal prompt (its ``prompt_ids`` are ``prompt.input_ids``)."""

    prompt: MultimodalPrompt
    embeds: torch.Tensor  # [num_media_tokens, H] on the model's device, prompt order

    @property
    def rope_delta(self) -> int:
        return self.prompt.rope_delta

    @property
    def media_keys(self) -> tuple[tuple[int, str], ...]:
        """``(first token index, content hash)`` of each media item: what the prefix cache keys media by,
        since every pad token of every image has the same id."""
        media, index = self.prompt.media, self.prompt.media_index
        if not media:
            return ()
        patches = [t * h * w for t, h, w in (m.grid for m in media)]
        per_token = sum(patches) // int((index >= 0).sum())  # merge**2 patches make one token
        keys, row = [], 0
        for item, n in zip(media, patches):
            keys.append((int((index == row).nonzero()[0, 0]), item.key))
            row += n // per_token
        return tuple(keys)

    def chunk(self, model: Qwen3_5TextModel, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [3, n], inputs_embeds [n, H])`` of prompt tokens ``[start, end)`` on the model's device."""
        positions = self.prompt.positions[:, start:end].to(model.device)
        return positions, chunk_embeds(model, self.prompt, self.embeds, start, end)


def forward_embeds(model: Qwen3_5TextModel, inputs_embeds: torch.Tensor, batch: ForwardBatch,
                   cache: ModelCache) -> torch.Tensor:
    """``Qwen3_5TextModel.forward`` from embeddings instead of ids: final-norm hidden states ``[N, H]``."""
    return model(batch, cache, inputs_embeds=inputs_embeds)


class MultimodalRunner:
    """One sequence at a time through a one-slot cache: chunked multimodal prefill, then decode."""

    def __init__(self, model: Qwen3_5TextModel, *, page_size: int = 64, kv_dtype: str = "auto") -> None:
        self.model, self.page_size, self.kv_dtype = model, page_size, kv_dtype
        self.cache: ModelCache | None = None
        self.length = 0
        self.rope_delta = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    def start(self, max_tokens: int) -> None:
        pages = -(-max_tokens // self.page_size)
        if self.cache is None or self.cache.num_pages < pages:
            self.cache = None  # free the old pool before allocating the larger one
            self.cache = ModelCache(self.model.config, num_pages=pages, page_size=self.page_size, num_slots=1,
                                    device=self.device, dtype=self.model.dtype,
                                    kv_dtype=self.kv_dtype)
        self.cache.reset_slot(0)
        self.length, self.rope_delta = 0, 0

    def _batch(self, ids: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        assert self.cache is not None, "call start() first"
        n, dev = ids.shape[0], self.device
        if self.length + n > self.cache.num_pages * self.page_size:
            raise ValueError("sequence is longer than the max_tokens given to start()")
        slots = torch.arange(self.length, self.length + n, device=dev)  # pages are laid out in order
        return ForwardBatch(
            input_ids=ids.to(dev), positions=positions.to(dev),
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([self.length + n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(self.cache.num_pages, dtype=torch.int32, device=dev)[None],
            slot_mapping=slots, state_slots=torch.zeros(1, dtype=torch.long, device=dev), max_seqlen=n)

    @torch.inference_mode()
    def prefill(self, prompt: MultimodalPrompt, media_embeds: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Run the whole prompt (in chunks of ``chunk`` tokens); returns its hidden states ``[N, H]``."""
        if self.length:
            raise ValueError("prefill starts a sequence: call start() first")
        inputs, outputs = MultimodalInputs(prompt, media_embeds), []
        for s in range(0, len(prompt.input_ids), chunk):
            e = min(s + chunk, len(prompt.input_ids))
            positions, x = inputs.chunk(self.model, s, e)  # what the engine's prefill step does per chunk
            batch = self._batch(torch.tensor(prompt.input_ids[s:e]), positions)
            outputs.append(forward_embeds(self.model, x, batch, self.cache))
            self.length = e
        self.rope_delta = prompt.rope_delta
        return torch.cat(outputs)

    @torch.inference_mode()
    def extend(self, token_ids: list[int]) -> torch.Tensor:
        """Append text tokens after the prompt; their positions are ``index + rope_delta`` on all axes."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.arange(self.length, self.length + len(token_ids)) + self.rope_delta
        hidden = self.model(self._batch(ids, pos.expand(3, -1)), self.cache)
        self.length += len(token_ids)
        return hidden

    @torch.inference_mode()
    def greedy(self, prompt: MultimodalPrompt, media_embeds: torch.Tensor, max_new_tokens: int,
               stop_ids: Sequence[int] = (), vocab_limit: int | None = None, chunk: int = 1024) -> list[int]:
        """Greedy continuation (argmax over ids below ``vocab_limit``), stopping after a stop id."""
        self.start(len(prompt.input_ids) + max_new_tokens)
        hidden = self.prefill(prompt, media_embeds, chunk)[-1:]
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self.model.logits(hidden)[0, :vocab_limit]
            token = int(logits.argmax())
            out.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                break
            hidden = self.extend([token])
        return out
