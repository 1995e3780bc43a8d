"""The speculative round's rows in one launch (CPU interpreter) against the reference, and the round plan against
the positions each forward of a round used to compute for itself."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.spec_rows import round_rows_reference, round_rows_triton
from ninfer.runtime.speculative import RoundPlan

PAGE = 16


@pytest.fixture
def poisoned_int_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's outputs are integers: fresh allocations hold -7777, so an unwritten element shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7777))


def lane_state(seed: int, lanes: list[int], max_lanes: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 200, (max_lanes,), generator=g)
    pages = torch.randperm(1000, generator=g)[:max_lanes * 16].view(max_lanes, 16).to(torch.int32)
    idx = torch.tensor(lanes)
    return {"lanes": idx, "start": start, "accepted": torch.randint(0, 4, (max_lanes,), generator=g),
            "rope_delta": torch.randint(-50, 50, (max_lanes,), generator=g), "block_tables": pages[idx]}


@pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")
@pytest.mark.usefixtures("poisoned_int_outputs")
@pytest.mark.parametrize(("lanes", "k"), [([0], 3), ([4, 1, 2], 3), ([5, 0], 1), ([3, 2, 1, 0, 5], 7)])
def test_round_rows_match_the_reference(lanes: list[int], k: int) -> None:
    state = lane_state(len(lanes) * 10 + k, lanes)
    plan = RoundPlan(len(lanes), k, torch.device("cpu"))
    args = (*state.values(), PAGE, plan.lane, plan.after, plan.offset, plan.tokens)
    out, ref = round_rows_triton(*args), round_rows_reference(*args)
    for name in ("positions", "positions32", "slots", "rope_positions"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    assert out.positions32.dtype == torch.int32 and out.slots.dtype == torch.long


@pytest.mark.parametrize(("lanes", "k"), [([0], 3), ([4, 1, 2], 3), ([5, 0], 1)])
def test_the_plan_gives_each_forward_its_positions(lanes: list[int], k: int) -> None:
    """Catch-up at ``start .. start + K``, draft step ``i`` at ``n + i - 1``, verification at ``n .. n + K`` with
    ``n = start + accepted + 1``; context lengths one past each forward's last token; slots through the block
    table; rotary positions shifted by the lane's delta."""
    b, t = len(lanes), k + 1
    state = lane_state(b + k, lanes)
    plan = RoundPlan(b, k, torch.device("cpu"))
    rows = round_rows_reference(*state.values(), PAGE, plan.lane, plan.after, plan.offset, plan.tokens)
    start, acc = state["start"][state["lanes"]], state["accepted"][state["lanes"]]
    n = start + acc + 1
    steps = torch.arange(t)
    expected = [start[:, None] + steps] + [(n + i - 1)[:, None] for i in range(1, k)] + [n[:, None] + steps]
    assert len(plan.token_rows) == len(plan.context_rows) == k + 1
    for f, positions in enumerate(expected):
        got = rows.positions[plan.token_rows[f]]
        assert torch.equal(got, positions.reshape(-1)), f
        assert torch.equal(rows.positions32[plan.context_rows[f]], (positions[:, -1] + 1).int()), f
        pages = state["block_tables"].gather(1, positions // PAGE).long()
        assert torch.equal(rows.slots[plan.token_rows[f]], (pages * PAGE + positions % PAGE).reshape(-1)), f
        delta = state["rope_delta"][state["lanes"]]
        assert torch.equal(rows.rope_positions[plan.token_rows[f]], (positions + delta[:, None]).reshape(-1)), f
    assert torch.equal(rows.positions[plan.first_verified], n)
    # every slice 16-byte aligned (int64 and int32), as the plain decode's fresh tensors are
    assert all(part.start % 4 == 0 for part in [*plan.token_rows, *plan.context_rows, plan.first_verified])
