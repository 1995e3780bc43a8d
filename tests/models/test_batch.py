"""make_batch, the one constructor of ForwardBatch: host lists and tensors give the same batch."""
from __future__ import annotations

import pytest
import torch

from ninfer.models.batch import make_batch

TABLES = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)


def test_lists_and_tensors_build_the_same_batch() -> None:
    from_lists = make_batch(input_ids=[5, 6, 7, 8], positions=[9, 0, 1, 2], seq_lens=[1, 3], context_lens=[10, 3],
                            block_tables=TABLES, slot_mapping=[201, 128, 129, 130], state_slots=[4, 2])
    from_tensors = make_batch(input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([9, 0, 1, 2]).expand(3, 4),
                              cu_seqlens=torch.tensor([0, 1, 4], dtype=torch.int32), max_seqlen=3,
                              context_lens=torch.tensor([10, 3], dtype=torch.int32), block_tables=TABLES,
                              slot_mapping=torch.tensor([201, 128, 129, 130]), state_slots=torch.tensor([4, 2]))
    for name in ("input_ids", "positions", "cu_seqlens", "context_lens", "slot_mapping", "state_slots"):
        a, b = getattr(from_lists, name), getattr(from_tensors, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert from_lists.positions.shape == (3, 4)  # one row of text positions stands for the three M-RoPE axes
    assert from_lists.cu_seqlens.dtype == torch.int32 and from_lists.context_lens.dtype == torch.int32
    assert from_lists.input_ids.dtype == torch.long and from_lists.slot_mapping.dtype == torch.long
    assert from_lists.max_seqlen == from_tensors.max_seqlen == 3 and from_lists.num_tokens == 4
    assert from_lists.last_token_indices().tolist() == [0, 3]
    assert from_lists.checkpoints == () and from_lists.ckpt_offsets is None and from_lists.state_out_slots is None


def test_device_tensors_are_used_as_they_are() -> None:
    ids = torch.tensor([1, 2])
    batch = make_batch(input_ids=ids, positions=torch.zeros(3, 2, dtype=torch.long), seq_lens=[2], context_lens=[2],
                       block_tables=TABLES[:1], slot_mapping=[0, 1], state_slots=[0])
    assert batch.input_ids is ids  # a CUDA graph's static buffer must stay the buffer the graph reads


def test_checkpoint_fields_are_carried() -> None:
    batch = make_batch(input_ids=[1, 2, 3], positions=[0, 1, 2], seq_lens=[3], context_lens=[3],
                       block_tables=TABLES[:1], slot_mapping=[0, 1, 2], state_slots=[1],
                       checkpoints=((0, 2, 1, 5),), ckpt_offsets=[2], ckpt_slots=[5])
    assert batch.checkpoints == ((0, 2, 1, 5),)
    assert batch.ckpt_offsets.dtype == torch.int32 and batch.ckpt_offsets.tolist() == [2]
    assert batch.ckpt_slots.dtype == torch.long and batch.ckpt_slots.tolist() == [5]


def test_the_packing_must_be_given() -> None:
    kw = dict(input_ids=[1], positions=[0], context_lens=[1], block_tables=TABLES[:1], slot_mapping=[0],
              state_slots=[0])
    with pytest.raises(ValueError, match="seq_lens or cu_seqlens"):
        make_batch(**kw)
    with pytest.raises(ValueError, match="max_seqlen"):
        make_batch(**kw, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))
