"""What one forward call computes: a packed batch of new tokens and where their state lives."""
from __future__ import annotations

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
