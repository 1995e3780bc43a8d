"""The speculative round's rows (one launch) against the reference on the GPU, eagerly and replayed from a graph."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.spec_rows import round_rows_reference, round_rows_triton
from ninfer.runtime.speculative import RoundPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV, PAGE, MAX_LANES, PAGES_PER_LANE = torch.device("cuda"), 64, 16, 600


def randomize(state: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state["start"].copy_(torch.randint(0, 30_000, (MAX_LANES,), generator=g))
    state["accepted"].copy_(torch.randint(0, 8, (MAX_LANES,), generator=g))
    state["rope_delta"].copy_(torch.randint(-500, 500, (MAX_LANES,), generator=g))
    state["block_tables"].copy_(torch.randperm(1_000_000, generator=g)[:state["block_tables"].numel()]
                                .view_as(state["block_tables"]))


@pytest.mark.parametrize(("b", "k"), [(1, 3), (8, 3), (16, 7)])
def test_round_rows_on_the_gpu_and_in_a_graph(b: int, k: int) -> None:
    lanes = torch.randperm(MAX_LANES, device=DEV)[:b]
    state = {"start": torch.zeros(MAX_LANES, dtype=torch.long, device=DEV),
             "accepted": torch.zeros(MAX_LANES, dtype=torch.long, device=DEV),
             "rope_delta": torch.zeros(MAX_LANES, dtype=torch.long, device=DEV),
             "block_tables": torch.zeros(b, PAGES_PER_LANE, dtype=torch.int32, device=DEV)}
    plan = RoundPlan(b, k, DEV)

    def rows(fn):  # noqa: ANN001, ANN202
        return fn(lanes, state["start"], state["accepted"], state["rope_delta"], state["block_tables"], PAGE,
                  plan.lane, plan.after, plan.offset, plan.tokens)

    names = ("positions", "positions32", "slots", "rope_positions")
    randomize(state, b)
    eager, ref = rows(round_rows_triton), rows(round_rows_reference)
    for name in names:
        assert torch.equal(getattr(eager, name), getattr(ref, name)), name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rows(round_rows_triton)
    randomize(state, b + 100)
    graph.replay()
    ref = rows(round_rows_reference)
    for name in names:
        assert torch.equal(getattr(captured, name), getattr(ref, name)), name
