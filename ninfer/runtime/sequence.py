"""One sequence at a time through the model: chunked prefill, then single-token decode.

The batched engine with shared KV pools and CUDA graphs replaces this for serving; scoring and
the simple generate path use it as is.
"""
from __future__ import annotations

import torch

from ninfer.models.batch import make_batch
from ninfer.models.cache import ModelCache
from ninfer.models.qwen3_5 import Qwen3_5TextModel


class SequenceRunner:
    """Owns a one-slot cache sized for the longest sequence seen so far."""

    def __init__(self, model: Qwen3_5TextModel, *, page_size: int = 64, prefill_chunk: int = 1024,
                 kv_dtype: str = "auto") -> None:
        self.model = model
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.kv_dtype = kv_dtype
        self.cache: ModelCache | None = None
        self.length = 0
        self.rope_delta = 0  # position offset of tokens after a multimodal prompt

    @property
    def device(self) -> torch.device:
        return self.model.device

    def start(self, max_tokens: int) -> None:
        """Begin a new sequence that will hold at most ``max_tokens`` tokens."""
        pages = -(-max_tokens // self.page_size)
        if self.cache is None or self.cache.num_pages < pages:
            self.cache = None  # free the old pool before allocating the larger one
            self.cache = ModelCache(self.model.config, num_pages=pages, page_size=self.page_size, num_slots=1,
                                    device=self.device, dtype=self.model.dtype,
                                    kv_dtype=self.kv_dtype)
        self.cache.reset_slot(0)
        self.length, self.rope_delta = 0, 0

    @torch.inference_mode()
    def extend(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens (in prefill chunks) and return their final hidden states ``[T, H]``."""
        assert self.cache is not None, "call start() first"
        if self.length + len(token_ids) > self.cache.num_pages * self.page_size:
            raise ValueError("sequence is longer than the max_tokens given to start()")  # before any step
        outputs = []
        for i in range(0, len(token_ids), self.prefill_chunk):
            outputs.append(self._step(token_ids[i:i + self.prefill_chunk]))
        return torch.cat(outputs)

    def _step(self, token_ids: list[int], positions: torch.Tensor | None = None,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One forward call over ``token_ids``; text positions (``index + rope_delta``) unless given."""
        device, n, start = self.device, len(token_ids), self.length
        assert self.cache is not None, "call start() first"
        if start + n > self.cache.num_pages * self.page_size:
            raise ValueError("sequence is longer than the max_tokens given to start()")
        slots = torch.arange(start, start + n, device=device)  # pages are laid out in order
        if positions is None:
            positions = (slots + self.rope_delta).expand(3, n)
        batch = make_batch(
            input_ids=token_ids, positions=positions, seq_lens=[n], context_lens=[start + n],
            block_tables=torch.arange(self.cache.num_pages, dtype=torch.int32, device=device)[None],
            slot_mapping=slots, state_slots=[0],
        )
        hidden = self.model(batch, self.cache, inputs_embeds=inputs_embeds)
        self.length += n
        return hidden
