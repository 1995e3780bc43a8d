"""What one forward call computes: a packed batch of new tokens and where their state lives.

Every batch is built by :func:`make_batch` (``tests/test_layers.py`` checks that nothing else calls the class).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A ragged batch of ``B`` sequences, each contributing ``seqlen_b >= 1`` new tokens.

    ``input_ids [N]`` and ``positions [3, N]`` (M-RoPE axes; equal rows for text) are packed by
    ``cu_seqlens [B + 1]``. ``context_lens [B]`` counts each sequence's tokens including the new
    ones; ``block_tables [B, max_pages]`` lists its KV pages and ``slot_mapping [N]`` the flat KV
    slot of each new token; ``state_slots [B]`` indexes its DeltaNet conv/recurrent state.

    ``state_out_slots [B, T]`` (speculative verification, every sequence ``T`` tokens): the DeltaNet
    state after token ``t`` of sequence ``b`` goes to slot ``state_out_slots[b, t]`` and
    ``state_slots`` are only read, so a rejected suffix is undone by choosing a slot.

    ``checkpoints`` (prefix cache), host ints per entry ``(row, r, own_slot, slot)``: the DeltaNet conv and
    recurrent state after the first ``r`` new tokens of the sequence whose tokens start at packed row
    ``row`` (state slot ``own_slot``) also goes to state slot ``slot``, inside this forward (ending the
    chunk there instead would cost the rest of the prompt another forward). ``ckpt_offsets [B]`` (``r``,
    0 for none) and ``ckpt_slots [B]`` carry the same on the device for the kernels.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    max_seqlen: int  # host-side: the most new tokens of any sequence (1 for a pure decode batch)
    state_out_slots: torch.Tensor | None = None
    checkpoints: tuple[tuple[int, int, int, int], ...] = ()
    ckpt_offsets: torch.Tensor | None = None
    ckpt_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """Index of each sequence's last new token in the packed batch (where logits are needed)."""
        return self.cu_seqlens[1:] - 1


Ints = Sequence[int] | torch.Tensor


def _on(values: Ints, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``: host lists are copied over once, tensors already there
    (a CUDA graph's static buffers) are used as they are."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)


def make_batch(*, input_ids: Ints, positions: Ints, context_lens: Ints, block_tables: torch.Tensor,
               slot_mapping: Ints, state_slots: Ints, seq_lens: Sequence[int] | None = None,
               cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
               state_out_slots: torch.Tensor | None = None,
               checkpoints: tuple[tuple[int, int, int, int], ...] = (),
               ckpt_offsets: Ints | None = None, ckpt_slots: Ints | None = None) -> ForwardBatch:
    """The one way a :class:`ForwardBatch` is built, on ``block_tables``' device.

    Each index field is a host list or a tensor (host tensors are copied over, device ones taken as they
    are); ``positions`` of one row (``[N]``) stand for all three M-RoPE axes. The packing is given either
    as ``seq_lens`` (new tokens per sequence: ``cu_seqlens`` and ``max_seqlen`` follow) or as ``cu_seqlens``
    and ``max_seqlen`` (static graph buffers, where the host does not know the lengths)."""
    device = block_tables.device
    if cu_seqlens is None:
        if seq_lens is None:
            raise ValueError("make_batch needs seq_lens or cu_seqlens")
        cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=device)
        max_seqlen = max(seq_lens) if max_seqlen is None else max_seqlen
    elif max_seqlen is None:
        raise ValueError("make_batch with cu_seqlens needs max_seqlen")
    cu_seqlens = cu_seqlens.to(device)
    ids = _on(input_ids, torch.long, device)
    pos = _on(positions, torch.long, device)
    if pos.dim() == 1:
        pos = pos.expand(3, pos.shape[0])
    return ForwardBatch(
        input_ids=ids, positions=pos, cu_seqlens=cu_seqlens,
        context_lens=_on(context_lens, torch.int32, device), block_tables=block_tables,
        slot_mapping=_on(slot_mapping, torch.long, device), state_slots=_on(state_slots, torch.long, device),
        max_seqlen=max_seqlen, state_out_slots=state_out_slots, checkpoints=checkpoints,
        ckpt_offsets=None if ckpt_offsets is None else _on(ckpt_offsets, torch.int32, device),
        ckpt_slots=None if ckpt_slots is None else _on(ckpt_slots, torch.long, device),
    )
