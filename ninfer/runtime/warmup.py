"""Start-up warm-up of an engine on CUDA: compile and autotune every kernel key serving will meet.

On a GPU the first chunk of a new length class costs seconds of compiling and benchmarking configs,
and prompts meet new classes late: a short turn after long prompts, the 1-token chunk before an
end-of-prompt checkpoint, the remainder up to a checkpoint interval. So the engine prefills one
chunk of each length class on scratch pages and a scratch state slot (given back after) before it
serves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer.kernels.attention.decode import DECODE_MAX_TOKENS
from ninfer.kernels.attention.prefill import (
    default_prefill_splits,
    forced_prefill_splits,
)
from ninfer.kernels.deltanet import RECURRENT_MAX_SEQLEN
from ninfer.models.batch import ForwardBatch
from ninfer.runtime import startup

if TYPE_CHECKING:
    from ninfer.runtime.engine import Engine


def warmup_chunk_lengths(longest: int) -> list[int]:
    """Prefill chunk lengths (up to ``longest``) that reach every autotune key one prompt's chunks can:
    each length the short-chunk kernels take (decode attention sizes its tile by the length; recurrent
    DeltaNet) and each power of two, since prefill attention (``tune_len``), quantized GEMMs (M bucket) and
    MoE GEMMs (``tune_m``) tune once per power-of-two bucket; ``longest`` reaches the bucket above it."""
    short = max(DECODE_MAX_TOKENS, RECURRENT_MAX_SEQLEN)
    lengths = {*range(1, short + 1), *(1 << i for i in range(longest.bit_length())), longest}
    return sorted(n for n in lengths if n <= longest)


@startup.timed("warm-up")
@torch.inference_mode()
def warm_up(engine: Engine) -> None:
    """Prefill one chunk of each length in :func:`warmup_chunk_lengths` as a one-sequence batch. Where that
    batch takes the split-KV prefill attention (short chunks: too few programs to fill the GPU), the
    chunk runs once more unsplit, the kernel a mixed step of the same length (the chunk plus decode
    rows: programs enough) takes."""
    config, ps, dev = engine.config, engine.config.page_size, engine.device
    # The longest step: prefill_chunk tokens (nothing decodes), or the budget while decoding plus up to
    # max_concurrency decode rows riding along (their GEMMs may reach the bucket above).
    riders = config.max_concurrency if engine.scheduler.pack_prefills else 0
    step = max(config.prefill_chunk, engine.scheduler.prefill_tokens_while_decoding + riders)
    longest = min(step, config.max_context - 1, engine.pages.num_available * ps)
    if longest < 1 or engine.slots.num_free == 0:
        return
    num_pages = -(-longest // ps)
    engine.pages.reserve(num_pages)
    pages, slot = [engine.pages.take_reserved() for _ in range(num_pages)], engine.slots.acquire()
    engine.lane_block_tables[0, :num_pages] = torch.tensor(pages, dtype=torch.int32)
    slot_mapping = torch.tensor([pages[p // ps] * ps + p % ps for p in range(longest)], dtype=torch.long, device=dev)
    heads = engine.model.config.num_attention_heads
    for n in warmup_chunk_lengths(longest):
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.long, device=dev),
            positions=torch.arange(n, device=dev).expand(3, n),
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=engine.lane_block_tables[:1], slot_mapping=slot_mapping[:n],
            state_slots=torch.tensor([slot], dtype=torch.long, device=dev), max_seqlen=n,
        )
        engine.cache.reset_slot(slot)
        engine.model.logits(engine.model(batch, engine.cache)[-1:])
        if n > DECODE_MAX_TOKENS and default_prefill_splits(dev, heads, 1, n) > 1:
            engine.cache.reset_slot(slot)
            with forced_prefill_splits(1):
                engine.model(batch, engine.cache)
    engine.cache.reset_slot(slot)
    engine.slots.release(slot)
    engine.pages.release(pages)
