"""The engine's mixed step: one forward over the decode rows and the prompt chunks of a step together.

The step reads the weights once instead of twice (a decode graph, then the prefill): decode rows are
sequences of one new token in the ragged batch. Each request's rows are prepared on its own, so one that
cannot be (``isolation.prepare_each``) is failed and left out of the batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer.models.batch import ForwardBatch
from ninfer.runtime.isolation import prepare_each, sample_each
from ninfer.runtime.request import Request, RequestOutput

if TYPE_CHECKING:
    from ninfer.runtime.engine import Engine


def mixed_step(engine: Engine, decode: list[Request], prefills: list[tuple[Request, int]],
               marks: dict[str, int], events: list[RequestOutput]) -> None:
    """One forward over ``decode`` (one new token each) and the prompt chunks ``prefills`` (request, end),
    its events appended to ``events``; runs eagerly, as every prefill does. ``marks``: prompt positions
    inside the chunks whose DeltaNet state the forward also writes to a prefix-cache slot."""
    dev = engine.device
    # Each request's rows first, on its own: one that cannot be prepared is failed and left out.
    decode_rows = prepare_each(decode, lambda r: (engine._slots_for(r, r.num_computed, r.num_computed + 1),
                                                  [r.output_ids[-1]]), "decode preparation", engine._fail, events)
    chunk_rows = prepare_each(prefills, lambda item: (engine._slots_for(item[0], item[0].num_computed, item[1]),
                                                      item[0].tokens(item[0].num_computed, item[1])),
                              "prefill preparation", engine._fail, events)
    decode, prefills = [r for r, _ in decode_rows], [item for item, _ in chunk_rows]
    if not decode and not prefills:
        return
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lengths: list[int] = []
    context: list[int] = []
    for req, (row_slots, row_ids) in decode_rows:
        p = req.num_computed
        slots += row_slots
        ids += row_ids
        positions.append(p + req.rope_delta)
        lengths.append(1)
        context.append(p + 1)
        req.num_computed = p + 1
    checkpoints = _forward_checkpoints(engine, prefills, marks, first_row=len(decode))
    for (req, end), (row_slots, row_ids) in chunk_rows:
        start = req.num_computed
        slots += row_slots
        ids += row_ids
        positions += range(start, end)
        lengths.append(end - start)
        context.append(end)
    reqs = decode + [req for req, _ in prefills]
    lanes = torch.tensor([r.lane for r in reqs], dtype=torch.long, device=dev)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
        positions=torch.tensor(positions, dtype=torch.long, device=dev).expand(3, len(ids)),
        cu_seqlens=cu.to(dev), context_lens=torch.tensor(context, dtype=torch.int32, device=dev),
        block_tables=engine.lane_block_tables[lanes],
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        state_slots=torch.tensor([r.slot for r in reqs], dtype=torch.long, device=dev), max_seqlen=max(lengths),
    )
    if checkpoints:
        offsets, targets = [0] * len(reqs), [0] * len(reqs)
        for i, _, row, r, slot in checkpoints:
            offsets[i], targets[i] = r, slot
        batch.checkpoints = tuple((row, r, req.slot, slot) for _, req, row, r, slot in checkpoints)
        batch.ckpt_offsets = torch.tensor(offsets, dtype=torch.int32, device=dev)
        batch.ckpt_slots = torch.tensor(targets, dtype=torch.long, device=dev)
    try:
        hidden = engine.model(batch, engine.cache)
    except Exception:
        for *_, slot in checkpoints:  # reserved for this forward's checkpoints, which will not exist
            engine.slots.release(slot)
        raise
    for _, req, _, r, slot in checkpoints:  # num_computed is still the chunk's start
        engine.prefix.adopt(req.tokens(0, req.num_computed + r), slot, req.pages, req.media_keys)
    rows, sampled = list(range(len(decode))), list(decode)  # the rows that sample a token, in order
    for i, (req, end) in enumerate(prefills, start=len(decode)):
        req.num_computed = end
        done = end >= req.prefill_target
        engine._maybe_checkpoint(req, done)
        if done:
            rows.append(int(cu[i + 1]) - 1)
            sampled.append(req)
    logits = engine.model.logits(hidden[torch.tensor(rows, device=dev)]) if sampled else None
    engine._launched()
    if logits is not None:
        for req, token, lp in sample_each(engine.sampler, logits, sampled, engine._fail, events):
            events.extend(engine._append(req, token, lp))


def _forward_checkpoints(engine: Engine, prefills: list[tuple[Request, int]], marks: dict[str, int],
                         first_row: int) -> list[tuple[int, Request, int, int, int]]:
    """``(i, req, row, r, slot)`` per request with a mark inside its chunk and a state slot to spare: its
    index in the batch, the chunk's first packed row, the tokens before the mark, the checkpoint's slot."""
    out = []
    row = first_row
    for i, (req, end) in enumerate(prefills, start=first_row):
        start, mark = req.num_computed, marks.get(req.request_id)
        if mark is not None and not engine.prefix.holds(req.tokens(0, mark), req.media_keys):
            slot = engine.prefix.reserve_slot()
            if slot is not None:
                out.append((i, req, row, mark - start, slot))
        row += end - start
    return out
