"""Where every token of a speculative round goes, in one launch: positions, KV slots, rotary positions.

A round runs several forwards over the same lanes (the catch-up over ``K + 1`` pairs, ``K - 1`` single-token
draft steps, the ``K + 1``-token verification), and each needs its tokens' positions, their slots in the paged
KV cache, their rotary positions and every sequence's context length. Computed per forward with torch ops that
is about ten small launches each (a gather, divisions, casts, adds: ~50 a K = 3 round); here one launch writes
them all into one flat buffer that the forwards slice.

A *plan* lists the round's rows, forward after forward. Row ``r`` belongs to lane ``lanes[lane[r]]`` and sits at
position ``start[l] + offset[r]`` (``after[r] == 0``) or ``start[l] + accepted[l] + 1 + offset[r]``
(``after[r] == 1``: past the tokens the last round committed). The first ``tokens`` rows are tokens (positions,
slots, rotary positions); the rows after them only need a position: context lengths are the position one past
a forward's last token, and they live past the end of the block table, so no slot is looked up for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton


@dataclass(frozen=True)
class RoundRows:
    """The rows of every forward of a round: ``positions`` (int64) and ``positions32`` for all rows,
    ``slots`` and ``rope_positions`` for the first ``tokens`` rows."""

    positions: torch.Tensor
    positions32: torch.Tensor
    slots: torch.Tensor
    rope_positions: torch.Tensor


def round_rows_reference(lanes: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor, rope_delta: torch.Tensor,
                         block_tables: torch.Tensor, page_size: int, lane: torch.Tensor, after: torch.Tensor,
                         offset: torch.Tensor, tokens: int) -> RoundRows:
    """``lanes [b]`` index the per-lane ``start`` / ``accepted`` / ``rope_delta``; ``block_tables [b, P]`` are the
    round's own rows (row ``i`` for ``lanes[i]``); ``lane`` / ``after`` / ``offset [R]`` are the plan."""
    who = lanes[lane]
    positions = start[who] + after * (accepted[who] + 1) + offset
    tok, lane_t = positions[:tokens], lane[:tokens]
    pages = block_tables[lane_t, tok // page_size].long()
    return RoundRows(positions, positions.int(), pages * page_size + tok % page_size, tok + rope_delta[who[:tokens]])


# One compiled kernel for every batch size and plan: no argument specialised on its value or alignment.
@triton.jit(do_not_specialize=["lanes_ptr", "start_ptr", "acc_ptr", "delta_ptr", "bt_ptr", "lane_ptr", "after_ptr",
                               "offset_ptr", "pos_ptr", "pos32_ptr", "slot_ptr", "rope_ptr", "s_bt", "page_size",
                               "rows", "tokens"])
def _round_rows_kernel(
    lanes_ptr, start_ptr, acc_ptr, delta_ptr, bt_ptr, lane_ptr, after_ptr, offset_ptr,
    pos_ptr, pos32_ptr, slot_ptr, rope_ptr, s_bt, page_size, rows, tokens, BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_plan = r < rows
    row_lane = tl.load(lane_ptr + r, mask=in_plan, other=0)
    who = tl.load(lanes_ptr + row_lane, mask=in_plan, other=0)
    after = tl.load(after_ptr + r, mask=in_plan, other=0)
    pos = (tl.load(start_ptr + who, mask=in_plan, other=0).to(tl.int64)
           + after * (tl.load(acc_ptr + who, mask=in_plan, other=0).to(tl.int64) + 1)
           + tl.load(offset_ptr + r, mask=in_plan, other=0))
    tl.store(pos_ptr + r, pos, mask=in_plan)
    tl.store(pos32_ptr + r, pos.to(tl.int32), mask=in_plan)
    is_token = in_plan & (r < tokens)
    page = tl.load(bt_ptr + row_lane.to(tl.int64) * s_bt + pos // page_size, mask=is_token, other=0).to(tl.int64)
    tl.store(slot_ptr + r, page * page_size + pos % page_size, mask=is_token)
    tl.store(rope_ptr + r, pos + tl.load(delta_ptr + who, mask=is_token, other=0), mask=is_token)


def round_rows_triton(lanes: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor, rope_delta: torch.Tensor,
                      block_tables: torch.Tensor, page_size: int, lane: torch.Tensor, after: torch.Tensor,
                      offset: torch.Tensor, tokens: int) -> RoundRows:
    """Triton :func:`round_rows_reference` (one launch); the block tables' rows need a unit column stride."""
    rows = lane.shape[0]
    assert block_tables.stride(1) == 1 and 0 <= tokens <= rows
    long = dict(dtype=torch.long, device=lane.device)
    out = RoundRows(torch.empty(rows, **long), torch.empty(rows, dtype=torch.int32, device=lane.device),
                    torch.empty(tokens, **long), torch.empty(tokens, **long))
    block = 256
    _round_rows_kernel[(triton.cdiv(rows, block),)](
        lanes, start, accepted, rope_delta, block_tables, lane, after, offset, out.positions, out.positions32,
        out.slots, out.rope_positions, block_tables.stride(0), page_size, rows, tokens, BLOCK=block, num_warps=4,
    )
    return out


def round_rows(lanes: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor, rope_delta: torch.Tensor,
               block_tables: torch.Tensor, page_size: int, lane: torch.Tensor, after: torch.Tensor,
               offset: torch.Tensor, tokens: int) -> RoundRows:
    """The plan's rows (:func:`round_rows_reference`): positions, KV slots and rotary positions."""
    fn = round_rows_triton if use_triton(lane) else round_rows_reference
    return fn(lanes, start, accepted, rope_delta, block_tables, page_size, lane, after, offset, tokens)
