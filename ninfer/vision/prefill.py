"""Running a multimodal prompt through the text model: vision embeddings scattered into the token rows.

The text model takes ``inputs_embeds`` in place of the embedding lookup (the M-RoPE tables come from
``batch.positions``, which for a multimodal prompt are the 3-axis positions of
:func:`ninfer.vision.prompt.rope_index`). Prefill chunks are built by :func:`chunk_embeds`, so a
prompt can be split anywhere, even inside an image.

:class:`MultimodalRunner` is the one-sequence driver (like ``runtime.sequence.SequenceRunner``):
prefill, then decode steps at ``len + rope_delta``; scoring and the parity tests use it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.models.vision import VisionTransformer
from ninfer.runtime.sequence import SequenceRunner
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


class MultimodalRunner(SequenceRunner):
    """One sequence at a time through a one-slot cache: chunked multimodal prefill, then text decode."""

    @torch.inference_mode()
    def prefill(self, prompt: MultimodalPrompt, media_embeds: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Run the whole prompt (in chunks of ``chunk`` tokens); returns its hidden states ``[N, H]``."""
        if self.length:
            raise ValueError("prefill starts a sequence: call start() first")
        inputs, outputs = MultimodalInputs(prompt, media_embeds), []
        for s in range(0, len(prompt.input_ids), chunk):
            e = min(s + chunk, len(prompt.input_ids))
            positions, x = inputs.chunk(self.model, s, e)  # what the engine's prefill step does per chunk
            outputs.append(self._step(prompt.input_ids[s:e], positions, x))
        self.rope_delta = prompt.rope_delta  # later tokens continue after the media's compressed positions
        return torch.cat(outputs)

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
